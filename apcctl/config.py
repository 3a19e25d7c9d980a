"""Which server(s) a command talks to, and with which token.

Precedence, highest first: command-line flags, then the environment (``APCCTL_SERVER``,
``APCCTL_TOKEN``, ``APCCTL_CONFIG``; click reads those for the flags), then the TOML file
(default ``user_config_dir("apcctl")/config.toml``), then the servers ``apcctl serve`` manages,
then ``http://127.0.0.1:8080``. Example file::

    default = "main"

    [servers.main]
    url = "http://127.0.0.1:8080"
    model = "~/models/glm5-next"
    port = 8080
    args = ["--max-kv-size", "65536"]
    ram_budget = "32G"           # APC_LINEAGE_RAM_BUDGET_BYTES at serve (default 48G)
    disk_budget = "200G"         # APC_LINEAGE_DISK_MAX_BYTES (default 1T)
    served_model_name = ["glm"]  # APC_SERVED_MODEL_NAME: what clients may send as "model"
    allowed_origins = ["http://127.0.0.1:3000"]  # APC_ALLOWED_ORIGINS: web UIs allowed in (CORS)
    shared_disk_path = "~/apc-shared"  # APC_SHARED_DISK_PATH: a disk tier shared with other servers

Sizes are read as the server reads them (``server_patch.settings``): bytes, or ``64M``,
``1.5G``, ``48GiB``; ``SIZE`` is the same parser as a click parameter type.

    [servers.big]
    url = "http://10.0.0.7:8080"
    token_file = "~/.config/apcctl/big.token"
    supervisor = "systemd"       # or "launchd"; `apcctl service install` records it itself
    service = "apcctl-big.service"
"""

from __future__ import annotations

import os
import stat
import tomllib
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from apcctl.core.client import AdminClient
from apcctl.core.config_keys import BUDGET_KEYS, PATH_KEYS, SERVING_KEYS
from apcctl.core.manage import ManagedServer, managed_names
from server_patch import settings as registry
from server_patch.envconfig import parse_size

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"
DEFAULT_NAME = "default"
_KEYS = {"url", "token", "token_file", "model", "port", "host", "supervisor", "service", "args", *BUDGET_KEYS,
         *SERVING_KEYS, *PATH_KEYS}


class ConfigError(ValueError):
    """The config file or a server selection is wrong (a usage error, exit 2)."""


class SizeType(click.ParamType):
    """A byte size on the command line, read like ``APC_*_BYTES``: ``4096``, ``64M``, ``48GiB``."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_size(param.get_error_hint(ctx) if param is not None else "size", str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeType()


def default_config_path() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("apcctl")) / "config.toml"


@dataclass(frozen=True)
class ServerConfig:
    """One ``[servers.NAME]`` table; every key is optional."""

    name: str
    url: str | None = None
    token: str | None = None
    token_file: Path | None = None
    model: str | None = None
    port: int | None = None
    host: str | None = None
    supervisor: str = "none"
    service: str | None = None
    args: tuple[str, ...] = ()
    budget_env: tuple[tuple[str, str], ...] = ()  # (APC_..., value) from the budget and serving keys

    def budget_environment(self) -> dict[str, str]:
        return dict(self.budget_env)


@dataclass(frozen=True)
class Config:
    path: Path | None
    servers: dict[str, ServerConfig] = field(default_factory=dict)
    default: str | None = None


def load_config(path: Path | None = None) -> Config:
    """Read ``path`` (it must exist), or the default path (which may be missing)."""
    explicit = path is not None
    path = Path(path).expanduser() if explicit else default_config_path()
    if not path.exists():
        if explicit:
            raise ConfigError(f"config file {path} does not exist")
        return Config(path=None)
    try:
        data = tomllib.loads(read_capped(path, CONFIG_MAX_BYTES))
    except RecursionError:
        raise ConfigError(f"cannot read config {path}: nested too deeply") from None
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(f"cannot read config {path}: {_why(exc)}") from None
    servers = {name: _server(name, table, path) for name, table in (data.get("servers") or {}).items()}
    default = data.get("default")
    if default is not None and default not in servers:
        raise ConfigError(f"{path}: default = {default!r} names no [servers.*] table")
    return Config(path=path, servers=servers, default=default)


def _server(name: str, table: Any, path: Path) -> ServerConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [servers.{name}] must be a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise ConfigError(f"{path}: [servers.{name}] has unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    from apcctl.core.restart import SUPERVISORS  # (the restart engine reads the server package's kinds)

    supervisor = table.get("supervisor", "none")
    if supervisor not in SUPERVISORS:
        raise ConfigError(f"{path}: [servers.{name}] supervisor must be one of {SUPERVISORS}")
    token_file = table.get("token_file")
    return ServerConfig(
        name=name, url=table.get("url"), token=table.get("token"),
        token_file=Path(token_file).expanduser() if token_file else None,
        model=table.get("model"), port=_int(table.get("port"), name, path), host=table.get("host"),
        supervisor=supervisor, service=table.get("service"), args=tuple(str(a) for a in table.get("args", ())),
        budget_env=_server_env(table, name, path),
    )


def _server_env(table: dict[str, Any], name: str, path: Path) -> tuple[tuple[str, str], ...]:
    """The budget and serving keys -> the variables the server reads, checked now (exit 2 if bad)."""
    out = []
    for key, variable in {**BUDGET_KEYS, **SERVING_KEYS, **PATH_KEYS}.items():
        if key not in table:
            continue
        convert = _budget_text if key in BUDGET_KEYS else _path_text if key in PATH_KEYS else _names_text
        try:
            out.append((variable, convert(key, variable, table[key])))
        except ValueError as exc:
            raise ConfigError(f"{path}: [servers.{name}] {exc}") from None
    return tuple(out)


def _budget_text(key: str, variable: str, value: Any) -> str:
    """``ram_budget = "48G"`` (or a number): the text of a size the server will parse alike."""
    text = str(value).strip()
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{key} must be a number or a string such as \"48G\"")
    try:
        number = registry.setting(variable).parse(text)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if number < 0:
        raise ValueError(f"{key} must be >= 0")
    return text


def _names_text(key: str, variable: str, value: Any) -> str:
    """``served_model_name = ["glm"]`` (or one string): the comma-separated list the server reads."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v.strip() and "," not in v for v in values):
        raise ValueError(f"{key} must be a string or a list of strings (none blank, none with a comma)")
    return ",".join(v.strip() for v in values)


def _path_text(key: str, variable: str, value: Any) -> str:
    """``shared_disk_path = "~/fleet"``: the path, ``~`` expanded ("" stays "": the feature off);
    whether the directory may be used is checked by ``apcctl serve``."""
    del variable
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string (a directory)")
    return str(Path(value).expanduser()) if value.strip() else ""


def _int(value: Any, name: str, path: Path) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{path}: [servers.{name}] port must be an integer port number")
    return value


@dataclass(frozen=True)
class Target:
    """A resolved server: where it is, how to authenticate, and whether ``apcctl serve`` runs it."""

    name: str
    url: str
    token: str | None
    settings: ServerConfig
    managed: ManagedServer | None = None
    token_problem: str | None = None  # why the configured token could not be read

    def client(self, timeout: float = 10.0) -> AdminClient:
        return AdminClient(self.url, self.token, timeout=timeout)


def is_url(value: str) -> bool:
    return "://" in value


def select(server: str | None = None, token: str | None = None, config_path: Path | None = None,
           all_servers: bool = False) -> list[Target]:
    """The servers a command acts on; ``server`` and ``token`` already include the environment."""
    config = load_config(config_path)
    if all_servers:
        if server:
            raise ConfigError("give either --server or --all, not both")
        names = list(dict.fromkeys([*config.servers, *managed_names()]))
        if not names:
            raise ConfigError("--all found no servers: none in the config file, none started by apcctl serve")
        return [resolve(name, token, config) for name in names]
    return [resolve(server or config.default or _sole(config) or DEFAULT_NAME, token, config)]


def _sole(config: Config) -> str | None:
    """The config's only server; with no server in the config, the only managed server."""
    if config.servers:
        return next(iter(config.servers)) if len(config.servers) == 1 else None
    names = managed_names()
    return names[0] if len(names) == 1 else None


def resolve(value: str, token: str | None, config: Config) -> Target:
    """A name from the config file or a managed server, or a URL (the same rule for every
    command, ``serve`` included: a URL names the configured or managed server at that URL)."""
    if is_url(value):
        name = _configured_at(value, config)
        if name is not None:
            return resolve(name, token, config)
        managed = _managed_at(value)
        settings = _supervised(ServerConfig(name=managed.name if managed else _url_name(value), url=value), managed)
        return _target(settings.name, value, token, settings, managed)
    settings = config.servers.get(value)
    managed = ManagedServer(value) if ManagedServer(value).spec() is not None else None
    if settings is None and managed is None and value != DEFAULT_NAME:
        known = sorted({*config.servers, *managed_names()})
        raise ConfigError(f"unknown server {value!r}; known: {', '.join(known) or 'none'} (or give a URL)")
    settings = _supervised(settings or ServerConfig(name=value), managed)
    url = settings.url or (managed.spec().url if managed else None) or _url(settings)
    return _target(value, url, token, settings, managed)


def server_name(value: str | None, config: Config) -> str:
    """The name ``apcctl serve`` (and ``service``) run a server under, from ``--server`` /
    ``APCCTL_SERVER`` resolved like every other command's: a name, or a URL that names a
    configured or managed server; default the config's ``default``, its only server, ``default``
    (never the only managed server, as other commands pick: a second ``serve`` is a new server)."""
    if not value:
        return config.default or (next(iter(config.servers)) if len(config.servers) == 1 else None) or DEFAULT_NAME
    if not is_url(value):
        return value
    name = _configured_at(value, config)
    managed = _managed_at(value)
    if name or managed:
        return name or managed.name  # type: ignore[union-attr]
    raise ConfigError(f"{value} names no server in the config file and none started by apcctl serve; "
                      "give a server name (--server NAME) to start one")


def _target(name: str, url: str, token: str | None, settings: ServerConfig, managed: ManagedServer | None) -> Target:
    found, problem = (token, None) if token else _token(settings, managed, url)
    return Target(name, url.rstrip("/"), found, settings, managed, problem)


def _configured_at(url: str, config: Config) -> str | None:
    """The config table whose ``url`` is ``url``."""
    wanted = url.rstrip("/")
    return next((n for n, s in config.servers.items() if s.url and s.url.rstrip("/") == wanted), None)


def _supervised(settings: ServerConfig, managed: ManagedServer | None) -> ServerConfig:
    """Add the supervisor ``apcctl service install`` recorded, unless the config names one."""
    if settings.supervisor != "none" or managed is None:
        return settings
    from apcctl.service.record import read_record

    record = read_record(managed.name, managed.directory.parent)
    if record is None:
        return settings
    return replace(settings, supervisor=record.supervisor, service=settings.service or record.service)


def _url(settings: ServerConfig) -> str:
    return f"http://{settings.host or DEFAULT_HOST}:{settings.port or DEFAULT_PORT}"


def _url_name(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    return parsed.netloc or url


def _managed_at(url: str) -> ManagedServer | None:
    """The managed server listening at ``url``, so a URL still finds its token and PID files."""
    for name in managed_names():
        if _same_server(ManagedServer(name), url):
            return ManagedServer(name)
    return None


def _token(settings: ServerConfig, managed: ManagedServer | None,
           url: str) -> tuple[str | None, str | None]:
    """The config's token or token file; else, for a managed server at the URL its record names,
    that server's own token; and, when none is found, why and what to do (said with the 401).

    A token found on this machine (``APC_ADMIN_TOKEN``, a server's token file) goes only to the
    managed server it belongs to: sent to any ``--server URL``, it would hand this machine's admin
    token to whatever listens there, over plain HTTP. Elsewhere only ``--token`` or the config's
    ``token`` / ``token_file`` are sent."""
    if settings.token:
        return settings.token, None
    if settings.token_file is not None:
        fix = "fix the path, or give --token or APCCTL_TOKEN"
        try:
            text = read_capped(settings.token_file, TOKEN_FILE_MAX_BYTES).strip()
        except FileNotFoundError:
            return None, f"the config's token_file {settings.token_file} does not exist; {fix}"
        except (OSError, ValueError) as exc:
            return None, f"cannot read the config's token_file {settings.token_file}: {_why(exc)}; {fix}"
        return (text, None) if text else (None, f"the config's token_file {settings.token_file} is empty; {fix}")
    owner = managed if managed is not None and _same_server(managed, url) else _managed_at(url)
    if owner is not None:  # (a config entry of another name may point at a managed server)
        found = owner.token()
        return found, None if found else f"server {owner.name!r} has no readable token file in {owner.directory}"
    return None, (f"no admin token was sent: {url} is not a server apcctl serve started, and a token found on "
                  "this machine (APC_ADMIN_TOKEN, a token file) goes to no other; give --token or APCCTL_TOKEN, "
                  "or token_file in the config")


def _same_server(managed: ManagedServer, url: str) -> bool:
    """``url`` is where ``managed``'s record says it listens (scheme, host and port)."""
    spec = managed.spec()
    return spec is not None and _endpoint(spec.url) == _endpoint(url)


def _endpoint(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url.strip())
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


TOKEN_FILE_MAX_BYTES = 4096  # a token is 64 characters; a bigger "token file" is not one
CONFIG_MAX_BYTES = 1 << 20


def read_capped(path: Path, max_bytes: int) -> str:
    """A regular file's UTF-8 text, at most ``max_bytes``: ``/dev/zero`` or a FIFO named as a
    config or token file is refused instead of read forever (``ValueError`` says why)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start})") from None


def _why(exc: Exception) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
