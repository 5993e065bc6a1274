"""The on-disk checkpoint format, below the launchers, the backends and the trainers.

- :mod:`~polytrain.checkpoint.storage`: local paths and ``fsspec`` URLs;
- :mod:`~polytrain.checkpoint.layout`: directory names, the manifest, the commit marker, retention;
- :mod:`~polytrain.checkpoint.pieces`: sharded state as ranges of the consolidated state;
- :mod:`~polytrain.checkpoint.directory`: writing and reading a checkpoint directory;
- :mod:`~polytrain.checkpoint.single_file`: the consolidated single-file format;
- :mod:`~polytrain.checkpoint.convert`: directory <-> single file, offline;
- :mod:`~polytrain.checkpoint.safetensors_export`: a checkpoint's model in the Hugging Face
  layout (safetensors files, shards + index, ``config.json``);
- :mod:`~polytrain.checkpoint.rng_state`: a worker's random states.

It imports only :mod:`polytrain.errors` and itself.
"""
