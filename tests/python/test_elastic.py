"""libmoe.Member against a real etcd started here on free loopback ports, its data in a temporary
folder removed at the end (as tools/elastic/etcd_server.c does for the C tests); keys are read
back through etcd's JSON gateway with urllib. Skipped when no etcd binary is installed (Debian:
etcd-server; scripts/setup-deps.sh installs it)."""
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import libmoe
from libmoe import Status

ENV = ("MOE_ELASTIC_ENDPOINT", "MOE_ELASTIC_PREFIX", "MOE_ELASTIC_SLOTS", "MOE_ELASTIC_TTL_MS")


def free_port():
    """A port the kernel gives for loopback (another program could take it before etcd does;
    etcd then fails to start and the test says so with its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def b64(text):
    return base64.b64encode(text.encode()).decode()


class Etcd:
    """A private etcd: start() waits until it answers a write; stop() ends it and its folder."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="moe-etcd-py-")
        client, peer = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
        self.endpoint = client
        self.log = os.path.join(self.dir, "etcd.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, "--name", "moe-py", "--data-dir", os.path.join(self.dir, "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"moe-py={peer}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def call(self, method, body):
        req = urllib.request.Request(f"{self.endpoint}/v3/{method}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.load(r)

    def wait_ready(self, seconds=30):
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                self.call("kv/put", {"key": b64("/moe/ready"), "value": b64("1")})
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        with open(self.log, errors="replace") as f:
            tail = f.read().strip().splitlines()[-1:] or ["(empty log)"]
        state = "exited" if self.proc.poll() is not None else "did not answer"
        raise RuntimeError(f"etcd at {self.endpoint} {state} within {seconds} s: {tail[0]}")

    def get(self, key):
        """The value of key as a dict (the member and exit records are JSON), or None."""
        kvs = self.call("kv/range", {"key": b64(key)}).get("kvs", [])
        return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class ElasticTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        binary = shutil.which("etcd")
        if binary is None:
            raise unittest.SkipTest("no etcd binary on PATH (Debian: etcd-server; "
                                    "scripts/setup-deps.sh installs it)")
        cls.etcd = Etcd(binary)
        try:
            cls.etcd.wait_ready()
        except RuntimeError:
            cls.etcd.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.etcd.stop()

    def setUp(self):
        self.base_handles = libmoe.live_handles()
        saved = {k: os.environ.get(k) for k in ENV}
        self.addCleanup(self._restore_env, saved)

    def tearDown(self):
        self.assertEqual(libmoe.live_handles(), self.base_handles, "leaked handles")

    @staticmethod
    def _restore_env(saved):
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def wait_for(self, key, pred, seconds=5):
        """The value of key once pred(value) holds; fails with the last value seen after
        seconds (the member's thread writes reports asynchronously)."""
        end = time.monotonic() + seconds
        value = self.etcd.get(key)
        while not pred(value) and time.monotonic() < end:
            time.sleep(0.02)
            value = self.etcd.get(key)
        self.assertTrue(pred(value), f"{key} = {value}")
        return value

    def test_member_reports_and_exits(self):
        prefix = "/py/job/inc/0"
        key = f"{prefix}/member/5"
        with libmoe.Member(endpoint=self.etcd.endpoint, prefix=prefix, slot=5, rank=1,
                           ttl_ms=2000) as m:
            v = self.etcd.get(key)
            self.assertEqual((v["slot"], v["rank"], v["phase"], v["pid"]),
                             (5, 1, "started", os.getpid()))
            m.report("resumed", 30)
            m.report(libmoe.ElasticPhase.TRAINING, 31)
            v = self.wait_for(key, lambda v: v and v["step"] == 31)
            self.assertEqual((v["slot"], v["rank"], v["phase"], v["resumed_step"]),
                             (5, 1, "training", 30))
            with self.assertRaisesRegex(ValueError, "unknown ElasticPhase 'done'"):
                m.report("done", 32)
            self.assertEqual(m.slot, 5)
            for step in range(1, 21):  # the key keeps the last 16 busy times
                m.report_busy(step, step / 1000)
            v = self.wait_for(key, lambda v: v and v.get("busy", [[0]])[-1][0] == 20)
            self.assertEqual(v["busy"], [[s, s / 1000] for s in range(5, 21)])
            with self.assertRaises(libmoe.Error) as cm:
                m.report_busy(21, -1.0)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            m.report_exit(libmoe.EXIT_PEER_LOST, "peer 3 lost")
            e = self.etcd.get(f"{prefix}/exit/5")
            self.assertEqual((e["slot"], e["rank"], e["code"], e["step"], e["cause"]),
                             (5, 1, libmoe.EXIT_PEER_LOST, 31, "peer 3 lost"))
        self.assertTrue(m.closed)
        self.assertIsNone(self.etcd.get(key), "the lease's key outlived close()")
        self.assertIsNotNone(self.etcd.get(f"{prefix}/exit/5"), "the exit record is kept")
        m.close()  # a second close is a no-op
        with self.assertRaises(libmoe.Error) as cm:
            m.report("training", 32)
        self.assertEqual(cm.exception.status, Status.INVALID_HANDLE)

    def test_exit_without_cause(self):
        with libmoe.Member(self.etcd.endpoint, "/py/nocause", 0, 0) as m:
            m.report_exit(0)
        e = self.etcd.get("/py/nocause/exit/0")
        self.assertEqual((e["code"], e["step"], e["cause"]), (0, 0, ""))

    def test_orphaned_when_the_launcher_goes(self):
        launcher = libmoe.Member(self.etcd.endpoint, "/py/orphan/launcher", 0, 0, ttl_ms=2000)
        seen = threading.Event()
        why = []
        with libmoe.Member(self.etcd.endpoint, "/py/orphan/inc/0", 3, 0, ttl_ms=2000) as m:
            m.watch_launcher("/py/orphan/launcher/member/0", 60000)
            m.set_orphan_handler(lambda w: (why.append(w), seen.set()))
            self.assertFalse(seen.wait(1.5))  # the launcher's lease lives: not orphaned
            launcher.close()  # revokes the lease, so its key goes
            self.assertTrue(seen.wait(5), "no orphan callback after the launcher's key went")
            self.assertIn("launcher", why[0])

    def test_bad_config_is_refused(self):
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.Member(self.etcd.endpoint, "relative", 0, 0)
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
        self.assertEqual(cm.exception.call, "moe_elastic_member_create")
        with self.assertRaisesRegex(TypeError, "no option 'ttl'"):
            libmoe.Member(self.etcd.endpoint, "/py/x", 0, 0, ttl=1000)

    def test_from_env(self):
        for k in ENV:
            os.environ.pop(k, None)
        self.assertIsNone(libmoe.Member.from_env(0))
        os.environ.update(MOE_ELASTIC_ENDPOINT=self.etcd.endpoint,
                          MOE_ELASTIC_PREFIX="/py/env", MOE_ELASTIC_SLOTS="4,7",
                          MOE_ELASTIC_TTL_MS="2000")
        with libmoe.Member.from_env(1) as m:
            v = self.etcd.get("/py/env/member/7")
            self.assertEqual((v["slot"], v["rank"], v["phase"]), (7, 1, "started"))
            m.report("training", 3)
            self.wait_for("/py/env/member/7", lambda v: v and v["step"] == 3)
        self.assertIsNone(self.etcd.get("/py/env/member/7"))
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.Member.from_env(2)
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("MOE_ELASTIC_SLOTS", cm.exception.message)
        self.assertIn("world rank 2", cm.exception.message)
        os.environ["MOE_ELASTIC_TTL_MS"] = "soon"
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.Member.from_env(1)
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("MOE_ELASTIC_TTL_MS", cm.exception.message)

    def test_dead_endpoint_fails_in_bounded_time(self):
        start = time.monotonic()
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.Member(f"http://127.0.0.1:{free_port()}", "/py/dead", 0, 0,
                          request_timeout_ms=500)
        elapsed = time.monotonic() - start
        self.assertIn(cm.exception.status, (Status.REMOTE_ERROR, Status.TIMEOUT))
        self.assertLess(elapsed, 5.0)


if __name__ == "__main__":
    sys.exit(unittest.main())
