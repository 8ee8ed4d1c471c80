
import pytest

@pytest.mark.parametrize("i", range(23))
def test_case(i):
    assert i != 7 or __import__("os").environ.get("FAIL_SEVEN") != "1"
