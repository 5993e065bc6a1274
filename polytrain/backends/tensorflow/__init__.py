"""TensorFlow ``MultiWorkerMirroredStrategy`` on Ray actors, configured through ``TF_CONFIG``.

The backend binds two sides:

- :class:`~polytrain.backends.tensorflow.rendezvous.TFConfigRendezvous` (driver):
  asks every worker for its address and a free port, builds each worker's
  ``TF_CONFIG`` and sets it in the workers before they import TensorFlow;
- :class:`~polytrain.backends.tensorflow.strategy.MWMSStrategy` (worker): creates
  the ``tf.distribute`` strategy, checks the Keras model, sets the data sets'
  auto-sharding policy and moves the Keras state to and from numpy.

TensorFlow is imported only inside the worker side's methods, never when this
module is imported: the driver can resolve and configure the backend without
paying for (or initialising) TensorFlow. The names of the two sides' modules are
re-exported here.

The folder: ``config.py`` (the options; imports only the backend contracts and errors),
``backend.py`` (:class:`MultiWorkerMirroredBackend`, binding the parts), and the driver and worker
sides next to them. Importing this package imports no optional framework.
"""

from polytrain.backends.tensorflow.config import MWMSConfig

__all__ = ["MWMSConfig"]
