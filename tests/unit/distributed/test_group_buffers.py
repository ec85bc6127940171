"""The exchanges' one registry of per-group buffers (distributed/group_buffers.py): found by exchange and group name,
a replacement frees what it replaces, and release frees one exchange's, one group's or all of them, once each."""

import pytest

from torchtitan.distributed.group_buffers import (
    group_buffers,
    keep_group_buffers,
    release_group_buffers,
    required_group_buffers,
)


def test_buffers_are_kept_per_exchange_and_group_and_freed_once_on_replacement_or_release():
    freed = []
    for exchange in ("deepep", "symm_mem"):
        for group in ("0", "1"):
            keep_group_buffers(exchange, group, f"{exchange}/{group}", freed.append)
    assert group_buffers("deepep", "1") == "deepep/1" and group_buffers("toy", "1") is None

    keep_group_buffers("deepep", "1", "deepep/1 larger", freed.append)
    assert freed == ["deepep/1"] and group_buffers("deepep", "1") == "deepep/1 larger"
    release_group_buffers("symm_mem", "0")
    assert freed[1:] == ["symm_mem/0"] and group_buffers("symm_mem", "1") == "symm_mem/1"
    release_group_buffers("deepep")
    assert sorted(freed[2:]) == ["deepep/0", "deepep/1 larger"]
    release_group_buffers()
    assert freed[4:] == ["symm_mem/1"]
    release_group_buffers()  # nothing left: frees nothing twice
    assert len(freed) == 5


def test_required_buffers_are_the_kept_ones_or_an_error_saying_how_to_make_them():
    keep_group_buffers("deepep", "0", "deepep/0", lambda _: None)
    try:
        assert required_group_buffers("deepep", "0", "apply X") == "deepep/0"
        with pytest.raises(RuntimeError, match=r"no symm_mem buffers for process group '0': apply Y before running"):
            required_group_buffers("symm_mem", "0", "apply Y")
    finally:
        release_group_buffers()
