"""What a launcher's process session left behind: shared by the elastic tests, which each
assert that a finished moe_elastic leaves no process of its session running."""
import os


def session_left(sid):
    """Processes of session sid still alive (zombies excluded)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            f = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = f[f.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            left.append(int(pid))
    return left


def alive(pid):
    """Whether process pid still runs (a zombie counts as gone)."""
    try:
        st = open(f"/proc/{pid}/stat").read()
        return st[st.rindex(")") + 2] != "Z"
    except OSError:
        return False
