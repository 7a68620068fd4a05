"""Imported at start-up by the JAX child processes the tests run (on their PYTHONPATH).

Keras' `set_random_seed` imports TensorFlow, when it is installed, only to
seed `tf.random`: 5 s of a JAX child's start-up that nothing in it uses.
Hiding the module makes Keras skip it (as where TensorFlow is not installed);
a child that does need TensorFlow fails loudly instead of silently.
"""

import os
import sys

if os.environ.get("KERAS_BACKEND") == "jax":
    sys.modules["tensorflow"] = None
