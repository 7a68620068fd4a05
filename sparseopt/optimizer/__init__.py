"""The Keras side: `DispatchOptimizer` (`dispatch.py` and its parts) and how it finds its
tables: who declared which updater (`discovery.py`, `keras_rs_tables.py`), where every
variable goes (`routing.py`, a pure plan), what is refused at build (`checks.py`)."""
