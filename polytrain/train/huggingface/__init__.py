"""Hugging Face libraries inside ``train_loop_per_worker``: Accelerate, the ``Trainer``, TRL.

Every torch function-API loop runs with the environment Accelerate reads
(:mod:`polytrain.train.huggingface.accelerate_scope`): an unmodified
``Accelerator()``, HF ``Trainer`` or TRL trainer built in the loop sees the
worker group's process group, its device and the backend's sharding.
:mod:`polytrain.train.huggingface.transformers` has Ray Train's
``prepare_trainer`` and ``RayTrainReportCallback``.
"""
