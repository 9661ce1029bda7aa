#!/bin/sh
# mpirun's remote launcher for simulated hosts (tests/elastic/simhost.py): called as ssh would
# be, `sim_rsh.sh [options] HOST COMMAND...`, it asks HOST's simhost to run COMMAND (orted) in
# that host's session and waits while it runs, as ssh does; ended (mpirun's teardown), it ends
# that command's process group (simhost.py makes one per command): the `sh -c` and the orted
# under it, as sshd's hangup ends a remote command (SIGTERM to the `sh` alone left the orted
# running until it noticed mpirun gone, after the test had checked that nothing was left).
# A host whose simhost is gone does not answer: exit 255, as ssh.
# SIM_HOSTS_DIR names the simulated hosts' folder.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
dir=${SIM_HOSTS_DIR:?SIM_HOSTS_DIR is not set}
sid=$(cat "$dir/$host.sid" 2>/dev/null) || exit 255
kill -0 "$sid" 2>/dev/null || exit 255
req="$dir/$host.req.$$"
printf '%s\n' "$*" > "$req.tmp" && mv "$req.tmp" "$req"
i=0
while [ ! -f "$req.pid" ]; do
    i=$((i + 1))
    [ $i -gt 200 ] && exit 255   # 10 s: the host does not answer
    kill -0 "$sid" 2>/dev/null || exit 255
    sleep 0.05
done
pid=$(cat "$req.pid")
trap 'kill -TERM "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; exit 0' TERM INT HUP
while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
exit 0
