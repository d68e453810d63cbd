"""Faults for unit tests of the store that run it in-process: a queue whose file cannot be opened, and the
disk as a crash in the middle of a flush would leave it."""
from __future__ import annotations

import errno
import os
import shutil


def no_descriptor_for(monkeypatch, topic: str):
    """Opening a consume-queue file of ``topic`` fails EMFILE (the process out of descriptors); the real
    ``MappedFile.create`` is returned, to put back for a test that goes on past the fault."""
    from broker.store import consume_queue
    real = consume_queue.MappedFile.create

    def no_descriptor(directory, *a, **kw):
        if os.sep + topic + os.sep in directory + os.sep:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(directory, *a, **kw)

    monkeypatch.setattr(consume_queue.MappedFile, "create", no_descriptor)
    return real


def image_each_flush(monkeypatch, store_dir) -> list:
    """Before each flush of the store's writer, a copy of ``store_dir`` beside it: the disk as a crash before
    that flush returns may leave it. The list of copies, in flush order, grows as the store flushes."""
    from broker.store import writer
    flush_ranges = writer._flush_ranges
    images = []

    def imaged(ranges):
        img = store_dir.parent / f"{store_dir.name}-img{len(images)}"
        shutil.copytree(store_dir, img, ignore=shutil.ignore_patterns("lock", "*.lock"))
        images.append(img)
        flush_ranges(ranges)

    monkeypatch.setattr("broker.store.writer._flush_ranges", imaged)
    return images
