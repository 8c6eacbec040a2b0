"""Waiting in the tests: for an outcome, polled, never for a fixed time."""

import time


def wait_for(check, what="a condition", timeout=120.0, every=0.05):
    """Polls ``check`` until it returns something true, and returns that; fails (an
    ``AssertionError`` naming ``what``) after ``timeout`` seconds. Generous by default: the
    suite runs on a loaded 2-core machine, and nothing here asserts speed."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)
