"""Tuning to this device and this drafter: what the online step reads, measured once, stored, reused.

profile.py    the device profile (verify and draft cost per context and row count), its fingerprint and
              store, the quick profile measured on first use, and the `--block-size auto` choice
calibrate.py  confidence records from live rollouts and the Sequential Temperature Scaling fit
policy.py     make_policy: the verify-length policy of a run, from its mode, calibration, acceptance and profile
"""

from .policy import make_policy

__all__ = ["make_policy"]
