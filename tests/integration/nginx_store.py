"""A private nginx serving a directory as a dsec HTTP image store, for tests.

    store = NginxStore("/tmp/some-store-root").start()
    store.url            # "http://127.0.0.1:41234": give it to `dsec image push/pull --store` or open_store()
    store.requests()     # what nginx answered so far, from its access log (method, uri, status, Range, ...)
    store.go_away()      # the store vanishes mid-run (SIGKILL): connections reset, new ones refused
    store.start()        # ... and comes back on the same port
    store.stop()         # graceful stop; nothing of it is left running, its prefix directory is removed

The directory is served the way an image store is laid out (blobs/sha256/<hex>, refs/<escaped name:tag>): GET and HEAD
with Range, PUT and DELETE through nginx's dav module (a PUT lands in a temporary file and is renamed into place, so a
half upload is never visible), and `autoindex_format json` listings for `dsec image ls` and garbage collection.

The nginx is dsec's own: its configuration, pid file, logs and temporary directories live in a private prefix
directory; /etc/nginx and any system nginx are never touched. Its listening socket is bound here and handed to nginx
(nginx's inherited-socket mechanism, the NGINX environment variable), so the port is known before nginx starts and no
other process can take it in between. With tls=True it serves https with a self-signed certificate for 127.0.0.1
whose file (store.ca_file) a client passes as its CA bundle.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time

NGINX = "/usr/sbin/nginx"
READY_PROBE = "/.dsec-ready"  # start()'s own request; requests() leaves it out

# One access-log line per request, tab-separated so that a field with spaces (the request line) stays one field.
_LOG_FIELDS = ("method", "uri", "status", "range", "bytes_sent", "request_length", "connection",
               "connection_requests", "request_time")
_LOG_FORMAT = "\\t".join(["$request_method", "$request_uri", "$status", "$http_range", "$body_bytes_sent",
                          "$request_length", "$connection", "$connection_requests", "$request_time"])


def skip_reason(nginx: str = NGINX) -> str | None:
    """Why a private nginx cannot run here, or None."""
    if not os.access(nginx, os.X_OK):
        return f"nginx is not installed at {nginx} (Debian: apt-get install nginx-light)"
    out = subprocess.run([nginx, "-V"], capture_output=True, text=True).stderr
    if "http_dav_module" not in out:
        return f"{nginx} was built without the dav module (PUT/DELETE): {out.strip().splitlines()[-1][:200]}"
    return None


def _config(root: pathlib.Path, prefix: pathlib.Path, port: int, tls: bool, workers: int, autoindex: str,
            location_extra: str, server_extra: str) -> str:
    user = "user root root;\n" if os.geteuid() == 0 else ""
    listen = f"listen 127.0.0.1:{port}" + (" ssl" if tls else "") + ";"
    if autoindex == "off":
        listing = "autoindex off;"
    elif autoindex in ("json", "html"):
        listing = f"autoindex on;\n      autoindex_format {autoindex};"
    else:
        raise ValueError(f"autoindex is json, html or off, not {autoindex!r}")
    ssl = ""
    if tls:
        ssl = (f"    ssl_certificate {prefix}/tls/cert.pem;\n"
               f"    ssl_certificate_key {prefix}/tls/key.pem;\n")
    return f"""# dsec test store: {root}
{user}daemon off;
master_process on;
worker_processes {workers};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 1024; }}
http {{
  types {{ }}
  default_type application/octet-stream;
  log_format dsec_store "{_LOG_FORMAT}";
  access_log {prefix}/access.log dsec_store;
  client_body_temp_path {root}/.tmp/nginx-body;
  proxy_temp_path {prefix}/tmp/proxy;
  fastcgi_temp_path {prefix}/tmp/fastcgi;
  uwsgi_temp_path {prefix}/tmp/uwsgi;
  scgi_temp_path {prefix}/tmp/scgi;
  client_max_body_size 0;
  keepalive_timeout 75s;
  keepalive_requests 100000;
  sendfile on;
  server {{
    {listen}
    server_name localhost;
{ssl}    root {root};
{server_extra}
    location / {{
      dav_methods PUT DELETE;
      create_full_put_path on;
      dav_access user:rw group:r all:r;
      {listing}
{location_extra}
    }}
  }}
}}
"""


def _self_signed_certificate(directory: pathlib.Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(directory / "key.pem"), "-out", str(directory / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)


class NginxStore:
    """A private nginx serving `root` as a dsec store on 127.0.0.1 (see the module's doc)."""

    def __init__(self, root: str | os.PathLike, *, tls: bool = False, autoindex: str = "json", nginx: str = NGINX,
                 workers: int = 1, extra_location_config: str = "", extra_server_config: str = "",
                 start_timeout: float = 10.0):
        """autoindex: "json" (listings dsec reads), "html" or "off" (a store that does not list). The extra_*
        strings are nginx directives added inside `location /` and inside `server` (e.g. "max_ranges 0;" for a server
        that ignores Range, or "location /broken/ { return 503; }")."""
        self.root = pathlib.Path(root).resolve()
        self.tls = tls
        self.autoindex = autoindex
        self.nginx = nginx
        self.workers = workers
        self.extra_location_config = extra_location_config
        self.extra_server_config = extra_server_config
        self.start_timeout = start_timeout
        self.prefix = pathlib.Path(tempfile.mkdtemp(prefix="dsec-nginx-store-"))
        self.port = 0
        self.process: subprocess.Popen | None = None

    # --- where it is ---
    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> str | None:
        """The certificate a client trusts for this store (tls=True), else None."""
        return str(self.prefix / "tls" / "cert.pem") if self.tls else None

    @property
    def access_log(self) -> pathlib.Path:
        return self.prefix / "access.log"

    @property
    def error_log(self) -> pathlib.Path:
        return self.prefix / "error.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # --- lifecycle ---
    def start(self) -> "NginxStore":
        """Starts nginx (again, on the same port after go_away()) and waits until it answers."""
        if self.running:
            return self
        reason = skip_reason(self.nginx)
        if reason:
            raise RuntimeError(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".tmp").mkdir(exist_ok=True)
        (self.prefix / "tmp").mkdir(exist_ok=True)
        if self.tls and not (self.prefix / "tls" / "cert.pem").exists():
            _self_signed_certificate(self.prefix / "tls")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(511)
            self.port = sock.getsockname()[1]
            conf = self.prefix / "nginx.conf"
            conf.write_text(_config(self.root, self.prefix, self.port, self.tls, self.workers, self.autoindex,
                                    self.extra_location_config, self.extra_server_config))
            env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "NGINX": f"{sock.fileno()};"}
            with open(self.prefix / "stderr.log", "ab") as err:
                self.process = subprocess.Popen(
                    [self.nginx, "-p", str(self.prefix), "-c", str(conf), "-e", str(self.error_log)],
                    stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, pass_fds=(sock.fileno(),),
                    start_new_session=True)
        finally:
            sock.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode} at start:\n{self.log_tail()}")
            # Ready once a worker answers a request: the kernel accepts into the inherited socket before that.
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                    if self.tls:
                        c = ssl.create_default_context(cafile=self.ca_file).wrap_socket(c, server_hostname="127.0.0.1")
                    c.sendall(f"HEAD {READY_PROBE} HTTP/1.0\r\n\r\n".encode())
                    if c.recv(16).startswith(b"HTTP/"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self._kill_group()
        raise RuntimeError(f"nginx did not answer on port {self.port} within {self.start_timeout}s:\n{self.log_tail()}")

    def go_away(self) -> None:
        """The store vanishes at once (SIGKILL to nginx and its workers): transfers in flight are cut, new
        connections refused. Logs and the served directory stay; start() brings it back on the same port."""
        self._kill_group()

    def stop(self, remove_prefix: bool = True) -> None:
        """Graceful stop (SIGQUIT: in-flight requests finish), then SIGKILL for whatever is left after a few seconds.
        Nothing of this nginx runs afterwards. The prefix (config, logs) is removed unless remove_prefix=False; the
        served directory is never touched."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGQUIT)
                self.process.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self._kill_group()
        if remove_prefix:
            shutil.rmtree(self.prefix, ignore_errors=True)

    def _kill_group(self) -> None:
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: nginx's master leads its own group, its workers are in it
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # Workers outlive a SIGKILLed master for a moment: wait until the group is empty.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"nginx process group {pgid} still has members after SIGKILL")

    def __enter__(self) -> "NginxStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- what it saw ---
    def requests(self) -> list[dict]:
        """One dict per request nginx has logged, oldest first: method, uri, status (int), range ("" when none),
        bytes_sent (int, body bytes), request_length (int), connection (int, nginx's connection serial number),
        connection_requests (int, 1 for a fresh connection), request_time (float seconds). nginx writes a line just
        after the response went out, so a client can see its answer a moment before the line is there: use
        wait_for_requests() to count."""
        try:
            text = self.access_log.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            parts = line.split("\t")
            if len(parts) != len(_LOG_FIELDS):
                continue
            entry = dict(zip(_LOG_FIELDS, parts))
            if entry["uri"] == READY_PROBE:
                continue
            if entry["range"] == "-":
                entry["range"] = ""
            for k in ("status", "bytes_sent", "request_length", "connection", "connection_requests"):
                entry[k] = int(entry[k])
            entry["request_time"] = float(entry["request_time"])
            out.append(entry)
        return out

    def wait_for_requests(self, count: int, timeout: float = 2.0) -> list[dict]:
        """requests(), once at least `count` are logged (or the timeout passes)."""
        deadline = time.monotonic() + timeout
        while True:
            reqs = self.requests()
            if len(reqs) >= count or time.monotonic() >= deadline:
                return reqs
            time.sleep(0.01)

    def clear_requests(self) -> None:
        """Empties the access log once it has stopped growing (so the line of the last answered request is in and
        goes too); nginx keeps appending to the same file."""
        deadline = time.monotonic() + 2
        while self.access_log.exists() and time.monotonic() < deadline:
            before = self.access_log.stat().st_size
            time.sleep(0.03)
            if self.access_log.stat().st_size == before:
                break
        if self.access_log.exists():
            with open(self.access_log, "r+b") as f:
                f.truncate(0)

    def log_tail(self, lines: int = 30) -> str:
        text = ""
        for p in (self.prefix / "stderr.log", self.error_log):
            try:
                text += "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) + "\n"
            except FileNotFoundError:
                pass
        return text
