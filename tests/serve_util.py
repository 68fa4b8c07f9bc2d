"""Start llm/server.py as a real process on a free localhost port (tests of paddletune.serve)."""
import os
import re
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProcess:
    def __init__(self, argv, timeout=120):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        # --port 0: the server binds any free port and prints it (no race for a port picked here)
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "llm", "server.py"), "--port", "0"]
                                     + list(argv), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.log = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited: " + "".join(self.log))
            self.log.append(line)
            m = re.search(r"on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        else:
            self.stop()
            raise RuntimeError("the server did not start: " + "".join(self.log))
        # keep draining stderr so the server never blocks on a full pipe
        import threading

        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()
        for _ in range(100):
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("the server does not answer /health: " + "".join(self.log))

    def health(self):
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
