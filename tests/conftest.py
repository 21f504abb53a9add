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
# The quick run (``python -m pytest`` without --slow) draws fewer examples per property.
settings.register_profile(
    "quick", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", deadline=None, max_examples=5000)

#: What turns the slow tests on besides ``--slow`` (.ci/run passes --slow).
ENV_SLOW = "SAFEVIEW_SLOW_TESTS"
SLOW_REASON = "tests marked slow are deselected: `python -m pytest --slow` runs them, as CI does"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (real engines in processes, long sweeps) and draw "
        f"200 examples per property instead of 50; {ENV_SLOW}=1 does the same",
    )


def _slow_wanted(config: pytest.Config) -> bool:
    return bool(config.getoption("--slow")) or os.environ.get(ENV_SLOW) == "1"


def pytest_configure(config: pytest.Config) -> None:
    default = "default" if _slow_wanted(config) else "quick"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))


def pytest_report_header(config: pytest.Config) -> str:
    if _slow_wanted(config):
        return "safeview: every test, slow ones included; 200 examples per property"
    return f"safeview: the quick run ({SLOW_REASON}); 50 examples per property"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --slow, the tests marked slow are deselected (counted as such in the summary)."""
    if _slow_wanted(config):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


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
