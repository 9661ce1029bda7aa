#!/usr/bin/env python3
"""A simulated host on one machine, for moe_elastic's agent tests (hosts_trials.py).

    simhost.py --dir DIR --host NAME -- AGENT COMMAND...

Started as the leader of its own session (the test's start_new_session): that session is the
"host". It runs the agent command in it, and serves mpirun's remote launches for the host:
sim_rsh.sh (mpirun's plm_rsh_agent) drops a request DIR/NAME.req.<id> holding the command line
Open MPI would give ssh (its orted), this program runs it with `sh -c` in the host's session, as
the leader of a process group of its own, and writes its pid to DIR/NAME.req.<id>.pid. So the host's agent, its orteds and their ranks share
one session, and killing the host (SIGKILL to every process of the session) loses all of them
at once, as a real host's loss does. It ends when the agent ends.

--tmp DIR gives the host a /tmp of its own, as a real host has: the orteds it starts (and so
their ranks) get TMPDIR=DIR, where Open MPI makes its session directory. Without it, the orteds
of every host and mpirun create the same /tmp/ompi.<node>.<uid>/jf.<job family>/0 at once, and
one of them can fail its mkdir ("File exists": orte_init fails, that host's ranks never start).
"""
import argparse
import os
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--host", required=True)
p.add_argument("--tmp", help="this host's own temporary folder (TMPDIR of its orteds)")
p.add_argument("command", nargs=argparse.REMAINDER)
a = p.parse_args()
cmd = a.command[1:] if a.command and a.command[0] == "--" else a.command
os.makedirs(a.dir, exist_ok=True)
with open(os.path.join(a.dir, a.host + ".sid"), "w") as f:
    f.write(str(os.getsid(0)))
log = open(os.path.join(a.dir, a.host + ".log"), "a")
remote_env = None  # the environment of what mpirun starts here (the agent keeps the test's)
if a.tmp:
    os.makedirs(a.tmp, exist_ok=True)
    remote_env = dict(os.environ, TMPDIR=a.tmp)
agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
started = []
tag = a.host + ".req."
while agent.poll() is None:
    for name in sorted(os.listdir(a.dir)):
        if not name.startswith(tag) or "." in name[len(tag):]:
            continue
        path = os.path.join(a.dir, name)
        try:
            line = open(path).read()
            os.rename(path, path + ".taken")
        except OSError:
            continue
        q = subprocess.Popen(["sh", "-c", line], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=remote_env,
                             preexec_fn=os.setpgrp)  # its own group: sim_rsh.sh ends it whole
        started.append(q)
        with open(path + ".pid.tmp", "w") as f:
            f.write(str(q.pid))
        os.rename(path + ".pid.tmp", path + ".pid")
    for q in started:
        q.poll()  # reaps the ended
    time.sleep(0.05)
sys.exit(agent.returncode)
