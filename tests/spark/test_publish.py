"""A rollup killed while it publishes its partitions loses no date of the history, and the next
run finishes what it left.

Spark's own dynamic overwrite deleted each partition it replaced and then renamed the new one in
(HadoopMapReduceCommitProtocol.commitJob): killed between the two, the date's rows of every broker
were gone. Two brokers' three days (test_history's store) are rolled up into one --out; then
broker-a's middle day is rolled up again in a child process killed by its own publish after N of
its steps (ops.spark.publish's renames and exchanges, counted), for N from 0 (staged, nothing
journalled) to all but the last partition.

After the kill every partition holds exactly the rows it held before (the re-run computes the same
rows), and a later run finishes or drops the half-done publish.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.spark.test_history import DATES, TABLES, build, rows

pytestmark = pytest.mark.spark

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAY = DATES[1]
TIMEOUT = 300


@pytest.fixture(scope="module")
def history(spark, tmp_path_factory):
    from ops.spark.rollup import run_rollup

    base = tmp_path_factory.mktemp("publish")
    stores = [str(base / name) for name in ("broker-a", "broker-b")]
    for s in stores:
        build(s)
    out = str(base / "out")
    run_rollup(spark, stores, out)
    dates = sorted(n[len("date="):] for n in os.listdir(os.path.join(out, "broker")) if n.startswith("date="))
    before = {(t, d): rows(spark, out, t, d) for t in TABLES for d in dates}
    assert all(before[(t, DAY)] for t in TABLES)
    return {"stores": stores, "out": out, "before": before}


def _copy_out(history, tmp_path) -> str:
    out = str(tmp_path / "out")
    shutil.copytree(history["out"], out)
    return out


def _rollup_args(history, out):
    return ["rollup", "--store-dir", history["stores"][0], "--out", out, "--date", DAY, "--master", "local[1]",
            "--no-progress", "--shuffle-partitions", "2"]


def _marker(out, table):
    return [n for n in os.listdir(os.path.join(out, table, f"date={DAY}")) if n.startswith(".txmq-run-")]


def _assert_intact(spark, history, out):
    for (t, d), want in history["before"].items():
        assert rows(spark, out, t, d) == want, (t, d)


def _converges(spark, history, out):
    from ops.spark.rollup import run_rollup

    run_rollup(spark, history["stores"][0], out, date=DAY)
    _assert_intact(spark, history, out)
    assert not os.path.exists(os.path.join(out, ".txmq-publish"))


KILLER = textwrap.dedent("""
    import os, sys
    from ops.spark import cli, publish

    left = int(sys.argv[1])

    def counted(step):
        def run(*args):
            global left
            if left == 0:
                os._exit(99)            # killed: no clean-up, no flush
            left -= 1
            return step(*args)
        return run

    publish._rename = counted(publish._rename)
    publish._exchange = counted(publish._exchange)
    sys.exit(cli.main(sys.argv[2:]))
""")


# The publish of one date: the journal's rename, then one swap per table (4).
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_killed_after_n_publish_steps_keeps_every_partition_and_the_next_run_finishes(spark, history, tmp_path,
                                                                                      steps):
    from ops.spark.publish import Publisher

    out = _copy_out(history, tmp_path)
    proc = subprocess.run([sys.executable, "-c", KILLER, str(steps), *_rollup_args(history, out)], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 99, proc.stderr[-2000:]
    assert os.path.isdir(os.path.join(out, ".txmq-publish"))
    _assert_intact(spark, history, out)
    journalled = steps > 0
    assert Publisher(spark, out).recover() is journalled
    assert not os.path.exists(os.path.join(out, ".txmq-publish"))
    for t in TABLES:       # a journalled run's partitions are all in (each holds that run's marker), or none is
        assert (_marker(out, t) != _marker(history["out"], t)) is journalled, t
    _assert_intact(spark, history, out)
    _converges(spark, history, out)


KILL_FS = """
package txmq;

import java.io.IOException;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;

/** The local file system, but the process dies at the first delete of a date partition that is not
 *  Spark's own staging: in commitJob's dynamic overwrite, after the delete and before the rename. */
public class KillFs extends LocalFileSystem {
    @Override
    public boolean delete(Path p, boolean recursive) throws IOException {
        boolean done = super.delete(p, recursive);
        if (p.getName().startsWith("date=") && !p.toString().contains("/.spark-staging")) {
            System.err.println("KILLFS: deleted " + p);
            System.err.flush();
            Runtime.getRuntime().halt(99);
        }
        return done;
    }
}
"""


@pytest.mark.skipif(shutil.which("javac") is None, reason="no javac: the kill hooks Hadoop's file system")
def test_killed_inside_sparks_own_commit_between_delete_and_rename_keeps_every_partition(spark, history, tmp_path):
    """Main's loss, reproduced where it happens: Spark's commitJob deletes each date partition it
    replaces, then renames the new one in; a file system that kills the driver right after that
    delete left main's --out without the date (every broker's rows). Here Spark's commit writes
    under .txmq-publish only, so the kill lands there and --out is untouched."""
    import glob

    import pyspark

    from ops.spark.publish import DIR

    src = tmp_path / "src" / "txmq"
    src.mkdir(parents=True)
    (src / "KillFs.java").write_text(KILL_FS)
    jars = glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "hadoop-client-api-*.jar"))
    subprocess.run(["javac", "-cp", ":".join(jars), "-d", str(tmp_path / "classes"), str(src / "KillFs.java")],
                   check=True, timeout=TIMEOUT)
    out = _copy_out(history, tmp_path)
    conf = {"spark.driver.extraClassPath": str(tmp_path / "classes"), "spark.hadoop.fs.file.impl": "txmq.KillFs",
            "spark.hadoop.fs.file.impl.disable.cache": "true"}
    args = [a for k, v in conf.items() for a in ("--conf", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "ops.spark", *_rollup_args(history, out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert "KILLFS: deleted" in proc.stderr and proc.returncode != 0, proc.stderr[-2000:]
    assert f"/{DIR}/new/" in proc.stderr.split("KILLFS: deleted", 1)[1].splitlines()[0]
    _assert_intact(spark, history, out)
    _converges(spark, history, out)


def _staged_by_hand(spark, tmp_path):
    """--out with traffic's DAY partition ("old"), and a Publisher that staged a new one ("new")."""
    from ops.spark import publish

    out = tmp_path / "out"
    (out / "traffic" / f"date={DAY}").mkdir(parents=True)
    (out / "traffic" / f"date={DAY}" / "part-0.parquet").write_bytes(b"old")
    pub = publish.Publisher(spark, str(out))
    staged = out / publish.DIR / "new" / "traffic" / f"date={DAY}"
    pub.stage("traffic")
    staged.mkdir(parents=True)
    (staged / "part-0.parquet").write_bytes(b"new")
    return out, pub, staged


def test_the_publish_is_on_disk_before_its_journal_and_the_journal_before_any_swap(spark, tmp_path, monkeypatch):
    """A power cut must not leave a journal whose contents never reached the disk (every later run
    failing on it) or swapped partitions with no journal: the new files, then the journal and its
    name, are synced before the first swap, and each table directory after its swaps. Hadoop's
    local file system takes hsync for a flush, and it syncs no directory."""
    from ops.spark import publish

    out, pub, staged = _staged_by_hand(spark, tmp_path)
    events = []
    real_fsync = os.fsync

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def swapped(step):
        def run(fs, a, b):
            events.append(("swap", a.toUri().getPath()))
            return step(fs, a, b)
        return run

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(publish, "_exchange", swapped(publish._exchange))
    pub.commit({"traffic": {DAY}})
    assert (out / "traffic" / f"date={DAY}" / "part-0.parquet").read_bytes() == b"new"
    synced = [p for kind, p in events if kind == "fsync"]
    first_swap = next(i for i, (kind, p) in enumerate(events) if kind == "swap" and p.endswith(f"date={DAY}"))
    before = synced[:sum(1 for kind, _ in events[:first_swap] if kind == "fsync")]
    root = str(out / publish.DIR)
    assert str(staged / "part-0.parquet") in before and str(staged) in before
    assert os.path.join(root, "journal.json.tmp") in before and root in before
    assert events[-1] == ("fsync", str(out / "traffic"))


def test_a_run_whose_staged_partitions_another_run_dropped_stops_and_removes_nothing(spark, tmp_path):
    """Runs into one hdfs:// --out have no lock. Another run's start takes this run's staged files
    for a killed run's and drops them; this run's commit then found no partition staged and took
    every date of the run for one with no rows any more: removed, every broker's rows gone."""
    from ops.spark import publish

    out, pub, staged = _staged_by_hand(spark, tmp_path)
    assert publish.Publisher(spark, str(out)).recover() is False      # the other run's start
    with pytest.raises(publish.PublishError, match="another rollup into the same --out"):
        pub.commit({"traffic": {DAY}})
    assert (out / "traffic" / f"date={DAY}" / "part-0.parquet").read_bytes() == b"old"


def test_a_table_on_another_file_system_is_refused_before_anything_is_published(spark, tmp_path, capsys,
                                                                                      monkeypatch):
    """A table directory linked to another disk: renames into it cross file systems, and Hadoop's local
    file system copies instead, file by file. Readers saw the old partition half deleted and the new one
    half copied, and a run killed after its run marker was copied left the partition half copied for
    good (the next run took the marker for a finished swap). Refused now, naming the table, before the
    journal; the old partition is untouched."""
    import uuid

    from ops.spark import publish

    other = f"/dev/shm/txmq-test-{uuid.uuid4().hex}"
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's tmp directory")
    out, pub, staged = _staged_by_hand(spark, tmp_path)
    shutil.move(str(out / "traffic"), other)
    try:
        os.symlink(other, out / "traffic")
        with pytest.raises(publish.PublishError, match=r"/traffic is on another file system than .*\.txmq-publish"):
            pub.commit({"traffic": {DAY}})
        assert (out / "traffic" / f"date={DAY}" / "part-0.parquet").read_bytes() == b"old"
        assert os.listdir(out / "traffic" / f"date={DAY}") == ["part-0.parquet"]
        assert not (out / publish.DIR / "journal.json").exists()
        with pytest.raises(publish.PublishError, match="traffic is on another file system"):
            publish.Publisher(spark, str(out)).check_tables(["broker", "traffic"])
        # The command says so in one line, before a Spark session starts (exit code 2).
        import logging

        from ops.spark import cli
        log = logging.getLogger("ops.spark")             # cli.main sets its handler up on this test's stderr
        for attr in ("handlers", "level", "propagate"):
            monkeypatch.setattr(log, attr, list(log.handlers) if attr == "handlers" else getattr(log, attr))
        from tests.spark.storegen import StoreBuilder

        with StoreBuilder(str(tmp_path / "store")) as b:
            b.send("Orders", b"x")
        assert cli.main(["rollup", "--store-dir", str(tmp_path / "store"), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().startswith(f"rollup: {out}/traffic is on another file system")
    finally:
        shutil.rmtree(other)


def test_a_table_bind_mounted_from_the_same_file_system_is_refused_too(tmp_path):
    """A bind mount (docker -v, mount --bind) of a directory of the same disk has the same device number, yet a
    rename into it is EXDEV all the same (Linux never renames across mounts): Hadoop copied, as for another
    disk. Compared by device alone it passed the check."""
    import subprocess as sp

    from ops.spark import publish

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (out / "traffic").mkdir(parents=True)
    (out / publish.DIR).mkdir()
    elsewhere.mkdir()
    if sp.run(["mount", "--bind", str(elsewhere), str(out / "traffic")], capture_output=True).returncode != 0:
        pytest.skip("needs mount --bind (root)")
    try:
        (out / publish.DIR / "probe").mkdir()
        with pytest.raises(OSError) as crossed:          # the premise: same device, still not one rename
            os.rename(out / publish.DIR / "probe", out / "traffic" / "probe")
        assert crossed.value.errno == errno.EXDEV
        assert os.stat(out / "traffic").st_dev == os.stat(out / publish.DIR).st_dev
        with pytest.raises(publish.PublishError, match="traffic is on another file system"):
            publish.check_tables(str(out), ["broker", "traffic"])
        publish.check_tables(str(out), ["broker"])       # the tables on --out's own mount are taken
    finally:
        sp.run(["umount", str(out / "traffic")], check=True)


def test_tables_of_an_out_on_one_mount_are_taken_however_it_is_named(tmp_path, monkeypatch):
    """No false refusals: a relative --out, one that does not exist yet, and tables not made yet are all on
    the mount of their nearest existing directory."""
    from ops.spark import publish

    monkeypatch.chdir(tmp_path)
    publish.check_tables("not/yet", ["broker", "traffic"])
    (tmp_path / "made" / "traffic").mkdir(parents=True)
    os.symlink(tmp_path / "made", tmp_path / "linked")            # --out itself a link: fine
    publish.check_tables("linked", ["broker", "traffic"])
    publish.check_tables(str(tmp_path / "made"), ["broker", "traffic"])


def test_a_table_that_cannot_be_stat_ed_is_one_line_naming_it_not_a_traceback(tmp_path, monkeypatch, capsys):
    """check_tables stats each table's directory: one in a directory this user may not search raised
    PermissionError out of the command's pre-checks, a traceback. Now one line naming the path, exit code 2,
    before a Spark session starts. (The tests run as root, whom no mode stops: the stat is made to refuse.)"""
    import logging

    from ops.spark import cli, publish
    from tests.spark.storegen import StoreBuilder

    with StoreBuilder(str(tmp_path / "store")) as b:
        b.send("Orders", b"x")
    out = tmp_path / "out"
    (out / "traffic").mkdir(parents=True)
    forbidden = str(out / "traffic")
    real_stat = os.stat

    def stat(path, *a, **kw):
        if os.fspath(path) == forbidden:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), forbidden)
        return real_stat(path, *a, **kw)
    log = logging.getLogger("ops.spark")             # cli.main sets its handler up on this test's stderr
    for attr in ("handlers", "level", "propagate"):
        monkeypatch.setattr(log, attr, list(log.handlers) if attr == "handlers" else getattr(log, attr))
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(publish.PublishError, match=f"cannot check where {forbidden} lives.*Permission denied"):
        publish.check_tables(str(out), ["broker", "traffic"])
    assert cli.main(["rollup", "--store-dir", str(tmp_path / "store"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rollup: cannot check where {forbidden} lives") and "\n" not in err
