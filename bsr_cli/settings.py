"""Settings and where each value came from.

Precedence, highest first: command-line flag > ``BSR_*`` environment variable > config file > default.
The config file is TOML at ``$BSR_CONFIG`` or ``~/.config/bsr/config.toml``::

    engine = "prod"                  # a profile name or a URL
    state_dir = "/var/lib/bsr"
    event_retention = "7d"           # how long `bsr engine up` keeps events (a duration)
    event_store_max = "512MiB"       # and how large its event store may grow (oldest events go first)
    store_client_ttl = "120s"        # how long bsr's Mooncake masters keep a silent segment holder

    [profiles.prod]
    url = "http://10.0.0.5:8470"
    token_file = "/etc/bsr/prod.token"   # or token = "..."

`bsr config show` prints every value with its source.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bsr_cli.core.limits import DEFAULT_STORE_CLIENT_TTL_S
from bsr_cli.errors import InvalidInput

ENV = {
    "engine": "BSR_ENGINE",
    "token": "BSR_TOKEN",
    "state_dir": "BSR_STATE_DIR",
    "config": "BSR_CONFIG",
    "json": "BSR_JSON",
    "traceback": "BSR_TRACEBACK",
    "timeout": "BSR_TIMEOUT",
    "event_retention": "BSR_EVENT_RETENTION",
    "event_store_max": "BSR_EVENT_STORE_MAX",
    "store_client_ttl": "BSR_STORE_CLIENT_TTL",
}
# BSR_DEBUG=1 is accepted as a synonym of BSR_TRACEBACK=1.
DEBUG_ENV = "BSR_DEBUG"
DEFAULT_TIMEOUT_S = 30.0
# What a config file may set (anything else is a typo, refused rather than ignored).
CONFIG_KEYS = frozenset(
    {"engine", "token", "state_dir", "timeout", "profiles", "event_retention", "event_store_max", "store_client_ttl"}
)
DEFAULT_EVENT_RETENTION_S = 7 * 86400.0  # the embedded engine's event store: events older than this are deleted
DEFAULT_EVENT_STORE_BYTES = 512 << 20  # ... and the oldest, beyond this size
MIN_EVENT_STORE_BYTES = 1 << 20
PROFILE_KEYS = frozenset({"url", "urls", "token", "token_file"})


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "bsr" / "config.toml"


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "bsr" / "engine"


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Profile:
    """An engine profile of the config file (``[profiles.NAME]``): one engine (``url``) or several (``urls``, URLs
    or other profiles' names, for `bsr status` and `bsr top`), and the token to send them: ``token``, or
    ``token_file`` (read when it is used, relative to the config file's directory)."""

    url: str = ""
    urls: tuple[str, ...] | None = None
    token: str | None = None
    token_file: Path | None = None


@dataclass
class Settings:
    engine: str | None = None
    token: str | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    config_path: Path = field(default_factory=default_config_path)
    json: bool = False
    traceback: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    event_retention_s: float = DEFAULT_EVENT_RETENTION_S
    event_store_bytes: int = DEFAULT_EVENT_STORE_BYTES
    # The client TTL of every Mooncake master bsr starts (`bsr engine up`, `bsr bench peer`; core.limits says why).
    store_client_ttl_s: int = DEFAULT_STORE_CLIENT_TTL_S
    profiles: dict[str, Profile] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def sourced(self) -> dict[str, SourcedValue]:
        """Every setting with where its value came from (the token's value masked), as `bsr config show` lists
        them."""
        shown: dict[str, str | float | bool | None] = {
            "engine": self.engine,
            "token": "***" if self.token else None,
            "state_dir": str(self.state_dir),
            "config": str(self.config_path),
            "json": self.json,
            "traceback": self.traceback,
            "timeout_s": self.timeout_s,
            "event_retention_s": self.event_retention_s,
            "event_store_bytes": self.event_store_bytes,
            "store_client_ttl_s": self.store_client_ttl_s,
        }
        return {k: SourcedValue(v, self.sources.get(k, "default")) for k, v in shown.items()}


@dataclass(frozen=True)
class SourcedValue:
    """A setting's value and where it came from (a flag, an environment variable, the config file, the default)."""

    value: str | float | bool | None
    source: str


@dataclass(frozen=True)
class SettingFlags:
    """The global options as given on the command line (None: not given)."""

    engine: str | None = None
    token: str | None = None
    state_dir: str | Path | None = None
    config: str | Path | None = None
    timeout_s: float | None = None
    json: bool | None = None
    traceback: bool | None = None
    # Not global options (the environment and the config file set them; `bsr engine up` has its own flags).
    event_retention_s: str | None = None
    event_store_bytes: str | None = None
    store_client_ttl_s: str | None = None


def load_settings(flags: SettingFlags, environ: dict[str, str] | None = None) -> Settings:
    """Resolve settings from flags (None = not given), the environment and the config file."""
    env = dict(os.environ if environ is None else environ)
    s = Settings()

    def pick(name: str, flag: Any, env_key: str, file_value: Any) -> tuple[Any, str] | None:
        if flag is not None:
            return flag, "flag"
        if env.get(env_key):
            return env[env_key], f"env {env_key}"
        if file_value is not None:
            return file_value, f"config {s.config_path}"
        return None

    cfg_flag = flags.config
    if cfg_flag is not None:
        s.config_path, s.sources["config"] = Path(cfg_flag), "flag"
    elif env.get(ENV["config"]):
        s.config_path, s.sources["config"] = Path(env[ENV["config"]]), f"env {ENV['config']}"
    file_cfg = _read_config(s.config_path, required=cfg_flag is not None or bool(env.get(ENV["config"])))
    unknown = sorted(set(file_cfg) - CONFIG_KEYS)
    if unknown:
        raise InvalidInput(
            f"{s.config_path}: unknown setting(s) {', '.join(unknown)}",
            hint=f"the config file knows: {', '.join(sorted(CONFIG_KEYS))}",
        )
    s.profiles = _profiles(file_cfg.get("profiles", {}), s.config_path)

    for name, key, conv in (
        ("engine", "engine", str),
        ("token", "token", str),
        ("state_dir", "state_dir", lambda v: Path(str(v)).expanduser()),
        ("timeout_s", "timeout", float),
        ("event_retention_s", "event_retention", parse_event_retention),
        ("event_store_bytes", "event_store_max", parse_event_store_bytes),
        ("store_client_ttl_s", "store_client_ttl", parse_client_ttl),
    ):
        got = pick(name, getattr(flags, name), ENV[key], file_cfg.get(key))
        if got is not None:
            try:
                setattr(s, name, conv(got[0]))
            except (TypeError, ValueError):
                raise InvalidInput(
                    f"bad value for {name} ({got[1]}): {got[0]!r}",
                    hint=f"`bsr config show` says where each value comes from; fix the {got[1]}",
                ) from None
            except InvalidInput as e:
                raise InvalidInput(f"bad value for {name} ({got[1]}): {e.message}", hint=e.hint) from None
            s.sources[name] = got[1]
    for name in ("json", "traceback"):
        flag = getattr(flags, name)
        if flag:
            setattr(s, name, True)
            s.sources[name] = "flag"
        elif env.get(ENV[name]) and _truthy(env[ENV[name]]):
            setattr(s, name, True)
            s.sources[name] = f"env {ENV[name]}"
    if not s.traceback and env.get(DEBUG_ENV) and _truthy(env[DEBUG_ENV]):
        s.traceback, s.sources["traceback"] = True, f"env {DEBUG_ENV}"
    if not math.isfinite(s.timeout_s) or s.timeout_s <= 0:
        raise InvalidInput(
            f"timeout must be a finite, positive number of seconds, got {s.timeout_s!r} "
            f"({s.sources.get('timeout_s', 'default')})",
            hint="e.g. --timeout 30",
        )
    return s


def _profiles(profiles: object, config_path: Path) -> dict[str, Profile]:
    """The config file's ``[profiles.NAME]`` tables, each checked (a token file relative to the config file)."""
    out: dict[str, Profile] = {}
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise InvalidInput(
            f"{config_path}: [profiles] must be a table of tables",
            hint="each profile is a [profiles.NAME] table with url (and token or token_file)",
        )
    for pname, prof in profiles.items():
        extra = sorted(set(prof) - PROFILE_KEYS)
        if extra:
            raise InvalidInput(
                f"{config_path}: profile {pname!r} has unknown setting(s) {', '.join(extra)}",
                hint=f"a profile knows: {', '.join(sorted(PROFILE_KEYS))}",
            )
        urls, token, token_file = prof.get("urls"), prof.get("token"), prof.get("token_file")
        if urls is not None and (not isinstance(urls, list) or not all(isinstance(u, str) for u in urls)):
            raise InvalidInput(
                f"profile {pname!r}: urls must be a list of URLs or profile names",
                hint='e.g. urls = ["http://10.0.0.5:8470", "prod-node2"]',
            )
        if token_file is not None and (not isinstance(token_file, str) or not token_file or token is not None):
            raise InvalidInput(
                f"profile {pname!r}: token_file must be a path, and given instead of token",
                hint='a profile takes token = "..." or token_file = "PATH" (relative to the config file)',
            )
        out[pname] = Profile(
            url=str(prof.get("url", "")),
            urls=None if urls is None else tuple(urls),
            token=None if token is None else str(token),
            token_file=None if token_file is None else config_path.parent / Path(token_file).expanduser(),
        )
    return out


def parse_event_retention(value: Any) -> float:
    """A duration (7d, 12h) or a number of seconds; at least a minute."""
    from bsr_cli.core.when import parse_duration

    seconds = float(value) if isinstance(value, int | float) else parse_duration(str(value))
    if not math.isfinite(seconds) or seconds < 60:
        raise InvalidInput(
            f"{value!r}: the event retention must be at least 1m", hint="give a duration of at least 1m, e.g. 7d"
        )
    return seconds


def parse_event_store_bytes(value: Any) -> int:
    """A size (512MiB) or a number of bytes; at least 1 MiB."""
    from bsr_cli.core.units import parse_bytes

    n = value if isinstance(value, int) and not isinstance(value, bool) else parse_bytes(str(value))
    if n < MIN_EVENT_STORE_BYTES:
        raise InvalidInput(
            f"{value!r}: the event store must be allowed at least 1MiB", hint="give at least 1MiB, e.g. 512MiB"
        )
    return n


def parse_client_ttl(value: Any, name: str = "the store's client TTL") -> int:
    """A duration (120s, 2m) or a number of seconds: the Mooncake master's client TTL, whole seconds in [1, 1d]."""
    from bsr_cli.core.limits import check_client_ttl
    from bsr_cli.core.when import parse_duration

    if isinstance(value, bool):
        seconds: float = math.nan
    elif isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        seconds = float(text) if text.replace(".", "", 1).isdigit() else parse_duration(text)
    whole = int(seconds) if math.isfinite(seconds) and seconds == int(seconds) else value
    return check_client_ttl(whole, name)


def resolve_store_client_ttl(flag: str | None, settings: Settings) -> int:
    """``--store-client-ttl`` when given, else the settings' (environment, config file, default)."""
    return settings.store_client_ttl_s if flag is None else parse_client_ttl(flag, "--store-client-ttl")


# The config file is read whole and checked key by key (load_settings): TOML of any shape until then.
def _read_config(path: Path, *, required: bool) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise InvalidInput(
                f"config file not found: {path}", hint="create it, or drop --config to use ~/.config/bsr/config.toml"
            ) from None
        return {}
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(
            f"{path}: not valid TOML ({e})",
            hint="fix the line the error names (TOML: key = value, [profiles.NAME] tables)",
        ) from None
    except UnicodeDecodeError:
        raise InvalidInput(
            f"{path}: not a text file (the config file is UTF-8 TOML)", hint="the config file is UTF-8 TOML"
        ) from None
    except OSError as e:
        raise InvalidInput(f"cannot read config file {path}: {e.strerror}", hint="check its permissions") from None
