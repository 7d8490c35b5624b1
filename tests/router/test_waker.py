"""Scale from zero's one decision: the guarded /scale write, only for a PagedLLM at zero."""

from __future__ import annotations

from pagedllm.router.waker import wake_patch


def test_at_zero_the_write_is_guarded_by_the_version_read() -> None:
    scale = {"metadata": {"resourceVersion": "41"}, "spec": {"replicas": 0}}
    assert wake_patch(scale, 2) == {"metadata": {"resourceVersion": "41"}, "spec": {"replicas": 2}}


def test_replicas_never_written_count_as_zero() -> None:
    assert wake_patch({"metadata": {"resourceVersion": "7"}, "spec": {}}, 1) == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"replicas": 1},
    }


def test_anything_above_zero_is_left_alone() -> None:
    assert wake_patch({"metadata": {"resourceVersion": "9"}, "spec": {"replicas": 1}}, 1) is None
    assert wake_patch({"metadata": {"resourceVersion": "9"}, "spec": {"replicas": 3}}, 1) is None
