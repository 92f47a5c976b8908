"""Tuning to this device and this drafter: what the online step reads, measured once, stored, reused.

profile.py    the device profile (verify and draft cost per context and row count), its fingerprint and
              store, the quick profile measured on first use, and the `--block-size auto` choice
calibrate.py  confidence records from live rollouts and the Sequential Temperature Scaling fit
policy.py     make_policy: the verify-length policy of a run, from its mode, calibration, acceptance and profile
spec.py       SpecConfig: the decoding configuration (proposer x verify mode), the one parser of the users'
              words, the table of each surface's defaults, and build(config, target) -> proposer, policy
"""

from .policy import make_policy
from .spec import SURFACE_DEFAULTS, SpecConfig, build, parse_spec

__all__ = ["make_policy", "SpecConfig", "parse_spec", "build", "SURFACE_DEFAULTS"]
