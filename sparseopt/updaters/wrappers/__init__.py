"""What wraps a rule: each an updater argument with its slots, its refusals, its part of a
step and of the end of `fit`, one module each, composed around any rule (after optax's
wrappers): `catch_up.py` (`lazy=False`: the steps a row missed, in closed form), `ema.py`
(`ema_momentum`), `swa.py` (`swa_period`), `lookahead.py` (`lookahead_period`)."""
