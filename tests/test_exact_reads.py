"""ExactReadFiles: which files a spoke opens without readahead, and for how long."""

from fuse_mount.exact_reads import ExactReadFiles
from neuralcache.hints import HintRecord


def test_only_exact_records_name_files_and_each_expires_after_its_last_record():
    files = ExactReadFiles(ttl=10.0)
    files.note(0.0, HintRecord(0, (("d/a.bin", 0, 16),), exact=False))
    assert not files.wants(1.0, "d/a.bin")
    files.note(0.0, HintRecord(0, (("d/a.bin", 0, 16), ("/d/b.bin", 16, 16)), exact=True))
    assert files.wants(5.0, "d/a.bin") and files.wants(5.0, "./d/b.bin")  # paths normalized
    assert not files.wants(5.0, "d/c.bin")
    files.note(8.0, HintRecord(1, (("d/a.bin", 0, 16),), exact=True))  # a later epoch renews a
    assert files.wants(12.0, "d/a.bin") and not files.wants(12.0, "d/b.bin")
    assert not files.wants(18.0, "d/a.bin")
