"""The dtypes a table or its state may be stored in (no backend needed to check them)."""

import keras
import numpy as np

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")
# Their largest finite values: (2 - 2^-7) 2^127 and (2 - 2^-10) 2^15.
LARGEST = {"bfloat16": 3.3895313892515355e38, "float16": 65504.0}


def check_dtype(owner, name, dtype):
    """`dtype` as a name from `FLOAT_DTYPES`, or a ValueError naming `owner` and `name`.

    Args:
        owner: who is given the dtype (an updater's class name), for the message.
        name: the argument's name, for the message.
        dtype: anything `keras.backend.standardize_dtype` takes.
    """
    try:
        standard = keras.backend.standardize_dtype(dtype)
    except (TypeError, ValueError):
        standard = None
    if standard not in FLOAT_DTYPES:
        raise ValueError(f"{owner}: `{name}` must be one of {list(FLOAT_DTYPES)}, "
                         f"got {dtype!r}.")
    return standard


def numpy_dtype(name):
    """The NumPy dtype of a dtype name; bfloat16 is `ml_dtypes.bfloat16` (Keras' own)."""
    if str(name) == "bfloat16":
        import ml_dtypes  # a dependency of Keras
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(str(name))
