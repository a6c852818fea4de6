"""PostgreSQL for the stack's servers that keep state (`stack.database: postgres`).

With SQLite (the default) Prefect's server and MLflow's tracking store keep files in the state
directory. With PostgreSQL they use the databases `prefect` and `mlflow` of either

- a cluster `crucible up` creates (initdb, once) and runs as a supervised service:

      <state>/postgres/data     the cluster, owned by stack.postgres_os_user when crucible runs as root
                                (PostgreSQL refuses to run as root); TCP on 127.0.0.1:stack.postgres_port
                                only, no unix socket, scram-sha-256 password auth
      <state>/secrets/postgres-password   the superuser `crucible`'s generated password (0600)
      <state>/secrets/pgpass              the same as a libpq password file: the servers get its
                                          path (PGPASSFILE), never the password

- or an existing server named by stack.postgres_url (no password in it: PGPASSWORD / PGPASSFILE).

MLflow's user store (its basic-auth app) stays SQLite in the state directory, beside the password it
checks (infra/stack.py `_mlflow_server_auth_env`). Either way `up` checks the server answers and
creates the databases before Prefect and MLflow start, and fails within stack.database_timeout
naming PostgreSQL and the setting when it does not.
The stack (infra/stack.py) supervises the server and passes its state directory (`state`) in.
Only the standard library is imported at module level (psycopg2 when the databases are checked).
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

DATABASES = ("prefect", "mlflow")
SUPERUSER = "crucible"  # the embedded cluster's superuser; the servers log in as it
PASSWORD_SECRET = "postgres-password"
PGPASS = "pgpass"
LOCAL_HOST = "127.0.0.1"
START_TIMEOUT = 60.0  # seconds for the embedded server to accept connections (crash recovery included)


class DatabaseError(RuntimeError):
    """PostgreSQL is missing, cannot be set up or does not answer; the message names the setting."""


def uses_postgres(stack_cfg) -> bool:
    return stack_cfg.database == "postgres"


def embedded(stack_cfg) -> bool:
    """The stack runs its own cluster (no stack.postgres_url)."""
    return uses_postgres(stack_cfg) and not stack_cfg.postgres_url


def server(stack_cfg) -> tuple[str, int, str]:
    """(host, port, user) of the PostgreSQL server the stack uses."""
    if stack_cfg.postgres_url:
        url = urlsplit(stack_cfg.postgres_url)
        return url.hostname or LOCAL_HOST, url.port or 5432, url.username or "postgres"
    return LOCAL_HOST, stack_cfg.postgres_port, SUPERUSER


def describe(stack_cfg, state: Path) -> str:
    """The server and the settings that chose it, for error messages (never a password)."""
    host, port, _ = server(stack_cfg)
    setting = f"stack.postgres_url={stack_cfg.postgres_url}" if stack_cfg.postgres_url else \
        f"stack.postgres_port={port}, cluster in {cluster_dir(state)}"
    return f"PostgreSQL at {host}:{port} (stack.database=postgres, {setting})"


def database_url(stack_cfg, database: str, driver: str = "") -> str:
    host, port, user = server(stack_cfg)
    return f"postgresql{'+' + driver if driver else ''}://{quote(user, safe='')}@{host}:{port}/{database}"


def prefect_database_url(stack_cfg, state: Path) -> str:
    """PREFECT_SERVER_DATABASE_CONNECTION_URL of the stack's Prefect server."""
    if uses_postgres(stack_cfg):
        return database_url(stack_cfg, "prefect", "asyncpg")
    return f"sqlite+aiosqlite:///{state / 'prefect' / 'prefect.db'}"


def mlflow_backend_uri(stack_cfg, state: Path) -> str:
    """--backend-store-uri of the stack's MLflow server (runs, model registry)."""
    if uses_postgres(stack_cfg):
        return database_url(stack_cfg, "mlflow")
    return f"sqlite:///{state / 'mlflow' / 'mlflow.db'}"


def mlflow_artifacts_root(stack_cfg, state: Path) -> str:
    """--artifacts-destination: stack.artifacts_root (a path or a URI such as s3://...) or the state dir."""
    return stack_cfg.artifacts_root or str(state / "mlflow" / "artifacts")


def server_env(stack_cfg, state: Path) -> dict[str, str]:
    """What a server using the embedded cluster needs in its environment: the password file's path.
    (An external server's password comes from the caller's own PGPASSWORD / PGPASSFILE.)"""
    return {"PGPASSFILE": str(pgpass_path(state))} if embedded(stack_cfg) else {}


# ------------------------------------------------------------------------ the embedded cluster

def cluster_dir(state: Path) -> Path:
    return state / "postgres"


def data_dir(state: Path) -> Path:
    return cluster_dir(state) / "data"


def pgpass_path(state: Path) -> Path:
    return state / "secrets" / PGPASS


def pg_bin(name: str) -> str:
    """A PostgreSQL program: Debian keeps them in /usr/lib/postgresql/<major>/bin (newest wins), else PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    path = str(found[-1]) if found else shutil.which(name)
    if not path:
        raise DatabaseError(f"PostgreSQL's `{name}` is not installed, and stack.database=postgres needs it: install "
                         "Debian's postgresql package (bash infra/system_packages.sh) or set stack.database=sqlite")
    return path


def _os_user(stack_cfg) -> pwd.struct_passwd | None:
    """The unprivileged account the cluster runs as when crucible runs as root; None: as ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(stack_cfg.postgres_os_user)
    except KeyError:
        raise DatabaseError(f"PostgreSQL refuses to run as root and the OS user stack.postgres_os_user="
                         f"{stack_cfg.postgres_os_user!r} does not exist (Debian's postgresql package creates "
                         "`postgres`)") from None


def _as_os_user(stack_cfg) -> list[str]:
    """Command prefix running a program as that account: setpriv execs it, so the service's pid is
    PostgreSQL's own and SIGTERM reaches it directly (runuser would fork and SIGKILL it after 2 s)."""
    user = _os_user(stack_cfg)
    if user is None:
        return []
    setpriv = shutil.which("setpriv")
    if not setpriv:
        raise DatabaseError("running PostgreSQL as an unprivileged user needs util-linux's `setpriv`")
    return [setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--"]


def postgres_command(stack_cfg, state: Path) -> list[str]:
    """`postgres -D <data>` in the foreground: loopback TCP only, settings on the command line."""
    return [*_as_os_user(stack_cfg), pg_bin("postgres"), "-D", str(data_dir(state)),
            "-c", f"listen_addresses={LOCAL_HOST}", "-c", f"port={stack_cfg.postgres_port}",
            "-c", "unix_socket_directories=", "-c", "password_encryption=scram-sha-256"]


def probe_command(stack_cfg) -> list[str]:
    """Exits 0 once the embedded server accepts connections (no login needed)."""
    return [pg_bin("pg_isready"), "-q", "-h", LOCAL_HOST, "-p", str(stack_cfg.postgres_port), "-t", "2"]


def os_user_name(stack_cfg) -> str:
    user = _os_user(stack_cfg)
    return user.pw_name if user else pwd.getpwuid(os.geteuid()).pw_name


def _write_private(path: Path, text: str, owner: pwd.struct_passwd | None = None) -> None:
    """Write a 0600 file atomically (optionally owned by `owner`)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if owner is not None:
        os.chown(tmp, owner.pw_uid, owner.pw_gid)
    os.replace(tmp, path)


def ensure_cluster(stack_cfg, state: Path, password: str) -> bool:
    """initdb the cluster unless it exists (superuser `crucible` with `password`); write the password
    file. True if the cluster was created now."""
    _write_private(pgpass_path(state), f"{LOCAL_HOST}:{stack_cfg.postgres_port}:*:{SUPERUSER}:{password}\n")
    data, root = data_dir(state), cluster_dir(state)
    if (data / "PG_VERSION").is_file():
        return False
    user = _os_user(stack_cfg)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
    if data.exists():  # left by an initdb that was interrupted: it never held data
        shutil.rmtree(data)
    pwfile = root / "initdb.pw"  # initdb reads the password from a file; it lives for this call only
    _write_private(pwfile, password + "\n", user)
    try:
        proc = subprocess.run([*_as_os_user(stack_cfg), pg_bin("initdb"), "-D", str(data), "-U", SUPERUSER,
                               f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8", "--locale=C"],
                              cwd=root, capture_output=True, text=True, timeout=300)
    finally:
        pwfile.unlink(missing_ok=True)
    if proc.returncode != 0:
        hint = ""
        if user is not None and "ermission denied" in proc.stdout + proc.stderr:
            hint = (f"\nThe cluster runs as OS user {user.pw_name!r}, which must be able to enter every parent "
                    f"directory of {root}: choose a stack.state_dir it can reach, or another stack.postgres_os_user.")
        raise DatabaseError(f"PostgreSQL's initdb failed for {data} (stack.database=postgres):\n"
                         f"{(proc.stdout + proc.stderr).strip()[-3000:]}{hint}")
    return True


# ---------------------------------------------------------------------------- both kinds

def connect(stack_cfg, state: Path, database: str = "postgres", timeout: float = 5.0):
    """A psycopg2 connection to the stack's server (the embedded one's password from its pgpass file)."""
    import psycopg2

    host, port, user = server(stack_cfg)
    extra = {"passfile": str(pgpass_path(state))} if embedded(stack_cfg) else {}
    return psycopg2.connect(host=host, port=port, user=user, dbname=database,
                            connect_timeout=max(1, int(timeout)), **extra)


def ensure_databases(stack_cfg, state: Path) -> list[str]:
    """Wait up to stack.database_timeout for the server to accept a login, then create the missing
    databases. Returns the ones created. StackError naming PostgreSQL and the setting otherwise."""
    import psycopg2
    from psycopg2 import sql

    t0 = time.monotonic()
    while True:
        left = stack_cfg.database_timeout - (time.monotonic() - t0)
        try:
            conn = connect(stack_cfg, state, timeout=min(5.0, max(1.0, left)))
            break
        except psycopg2.OperationalError as e:
            if left <= 0.5:
                reason = " ".join(str(e).split()).rstrip(".")
                raise DatabaseError(f"{describe(stack_cfg, state)} is not reachable after {time.monotonic() - t0:.1f}s "
                                 f"({reason}). Start PostgreSQL or correct the setting, or set "
                                 "stack.database=sqlite.") from None
            time.sleep(0.5)
    created = []
    try:
        conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database")
            have = {row[0] for row in cur.fetchall()}
            for name in DATABASES:
                if name not in have:
                    cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                    created.append(name)
    except psycopg2.Error as e:
        raise DatabaseError(f"{describe(stack_cfg, state)}: cannot create the databases {list(DATABASES)}: "
                         f"{' '.join(str(e).split())}") from None
    finally:
        conn.close()
    return created
