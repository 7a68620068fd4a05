"""The machinery every rule shares: the `Updater` base class and its registry (`base.py`),
hyperparameters as state and as the rule's argument (`hyperparameters.py`), the options'
transforms around any rule (`transforms.py`), Keras / keras-rs / SparseCore conversions
(`keras_conversion.py`), and the adapter of rules written with older signatures
(`legacy.py`)."""
