"""The daemon's startup freeze (fuse_mount.daemon.freeze_long_lived): what it keeps out of
later collections, and what it does not keep for good; and its pacing of later collections."""

import gc
import weakref

from prometheus_client import REGISTRY

from fuse_mount.daemon import GC_THRESHOLDS, freeze_long_lived, pace_collections


class _Node:
    pass


def test_garbage_is_collected_first_and_what_lives_on_is_left_out_of_later_collections():
    cycle = _Node()
    cycle.self = cycle  # garbage only a collection frees
    gone = weakref.ref(cycle)
    del cycle
    index = {(1, 1, block): block for block in range(1000)}
    assert any(o is index for o in gc.get_objects())  # walked until the freeze
    try:
        freeze_long_lived()
        assert gone() is None
        assert not any(o is index for o in gc.get_objects())  # no collection walks it
        assert index[(1, 1, 999)] == 999
    finally:
        gc.unfreeze()


def _full_collection_seconds() -> float:
    return REGISTRY.get_sample_value("neuralcache_gc_seconds_total", {"generation": "2"})


def test_collections_are_paced_and_timed() -> None:
    thresholds, callbacks = gc.get_threshold(), list(gc.callbacks)
    try:
        pace_collections()
        assert gc.get_threshold() == GC_THRESHOLDS
        before = _full_collection_seconds()
        gc.collect()
        assert _full_collection_seconds() > before
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks[:] = callbacks
