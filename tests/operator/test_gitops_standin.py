"""The GitOps stand-in's judgement of one apply (the e2e's check that re-applying changes
nothing): a moved generation is caught unless the autoscaler's write explains it."""

from __future__ import annotations

from pagedllm_testing.gitops_standin import Seen, moved, raced, without_replicas

STILL = Seen(generation=4, replicas=2, deployment_generation=7, deployment_replicas=2)


def test_an_apply_that_changed_nothing_passes() -> None:
    assert moved(STILL, STILL) is None and not raced(STILL, STILL)


def test_a_moved_generation_is_named() -> None:
    after = Seen(generation=5, replicas=2, deployment_generation=8, deployment_replicas=2)
    assert not raced(STILL, after)
    assert moved(STILL, after) == "PagedLLM generation 4 -> 5, Deployment generation 7 -> 8"


def test_an_autoscaler_write_meanwhile_is_a_race_not_a_fault() -> None:
    after = Seen(generation=5, replicas=3, deployment_generation=8, deployment_replicas=3)
    assert raced(STILL, after)


def test_the_repository_leaves_replicas_to_the_autoscaler() -> None:
    manifest = {"metadata": {"name": "demo"}, "spec": {"replicas": 2, "model": {"servedName": "x"}}}
    kept = without_replicas(manifest)
    assert kept == {"metadata": {"name": "demo"}, "spec": {"model": {"servedName": "x"}}}
    assert manifest["spec"]["replicas"] == 2  # the original is untouched
