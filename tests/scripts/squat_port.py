"""Runs a test script as a task, after another program took this task's port.

argv: ROLE:INDEX STATE_DIR SCRIPT [ARGS...]. On the task ROLE:INDEX, the first
time only (a marker in STATE_DIR), it starts a separate program in a session
of its own (so stopping the task's process group leaves it running, like any
other program on the machine) that listens on the port TF_CONFIG gives this
task, waits until it listens, and then runs SCRIPT with ARGS, whose server
then finds the port taken. The squatter writes its pid to STATE_DIR/squatter.pid;
the test stops it. Every other task, and any later start, runs SCRIPT directly.
"""

import json
import os
import runpy
import subprocess
import sys
import time

SQUATTER = """
import os, socket, sys, time
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(float(sys.argv[3]))  # a guard: the test stops it long before
"""


def main():
    target, state_dir, script, *args = sys.argv[1:]
    config = json.loads(os.environ["TF_CONFIG"])
    me = f"{config['task']['type']}:{config['task']['index']}"
    marker = os.path.join(state_dir, "squatted")
    if me == target and not os.path.exists(marker):
        open(marker, "w").close()
        role, index = config["task"]["type"], config["task"]["index"]
        port = config["cluster"][role][index].rpartition(":")[2]
        pid_file = os.path.join(state_dir, "squatter.pid")
        subprocess.Popen([sys.executable, "-c", SQUATTER, port, pid_file, "600"],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(pid_file):
            if time.monotonic() > deadline:
                sys.exit("the squatter did not start")
            time.sleep(0.05)
        print(f"squat_port: another program now listens on port {port}", flush=True)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
