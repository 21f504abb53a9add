from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from safeview import log, policy

settings.register_profile(
    "default", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", deadline=None, max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _clean_safeview_state() -> Iterator[None]:
    """Every test starts with no scope, the environment read afresh, and logging as imported."""
    assert os.environ.get(policy.ENV_POLICY) is None, "run the tests without SAFEVIEW_BOUNDS_POLICY"
    policy._from_env = None
    token = policy._scopes.set(())
    log.reset_logging()
    yield
    policy._scopes.reset(token)
    log.reset_logging()
    logging.getLogger(log.LOGGER_NAME).setLevel(logging.NOTSET)
