"""The gateway's configuration: arms, routing mode, limits, health checks, scraping and the admin listener.

Loaded from YAML (`dfserve gateway --config gateway.yaml`), overridden by flags, and validated when built, so a bad
file or a bad `PUT /admin/arms` body is refused before it can touch live traffic::

    schema_version: 1
    mode: split            # split | sticky | shadow
    arms:
      baseline: {weight: 90, replicas: ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]}
      candidate: {weight: 10, replicas: ["http://10.0.0.3:30000"]}
    admin: {port: 9001, token_env: DFSERVE_ADMIN_TOKEN}
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dfserve.capture.format import CapturePolicy
from dfserve.errors import FieldError, UserError, describe_invalid
from dfserve.headers import is_field_name
from dfserve.http1 import is_base_url
from dfserve.metrics import ARM_NAME, ARM_NAME_RULE
from dfserve.shadow.policy import ShadowPolicy
from dfserve.yamlfile import read_yaml

Mode = Literal["split", "sticky", "shadow"]
MAX_WEIGHT = 1e6
"""Weights are relative shares; a bound keeps their sum, and so the split, exact (two weights of 1e308 add up to
infinity, which sends everything to the last arm)."""


class _Model(BaseModel):
    """Every number finite: an infinite timeout or interval is no setting a timer can hold. Strict: `port: true`
    or `weight: "50"` is a mistake in the file, not a number to guess at (an int still passes for a float). YAML
    and JSON have no tuples, so tuple fields take lists (`Field(strict=False)`), their items still strict."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class ArmConfig(_Model):
    """One deployment under test: its replicas (SGLang servers or routers) and its share of traffic."""

    replicas: tuple[str, ...] = Field(min_length=1, strict=False,
                                      description="Base URLs, e.g. http://10.0.0.1:30000.")
    weight: float = Field(ge=0, le=MAX_WEIGHT, allow_inf_nan=False,
                          description=f"Relative share of traffic in split and sticky modes, 0 to {MAX_WEIGHT:g}.")

    @field_validator("replicas")
    @classmethod
    def _urls(cls, replicas: tuple[str, ...]) -> tuple[str, ...]:
        cleaned = []
        for url in replicas:
            parts = urlsplit(url)
            if (not is_base_url(url) or parts.path not in ("", "/") or parts.query or parts.fragment
                    or parts.username is not None or " " in url):
                raise ValueError(f"{url!r} is not a base URL like http://host:port")
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("a replica is listed twice")
        return tuple(cleaned)


class RoutingConfig(_Model):
    """What `PUT /admin/arms` replaces atomically: the arms and how traffic is divided between them."""

    mode: Mode = "split"
    arms: dict[str, ArmConfig] = Field(min_length=1)
    primary: str | None = Field(None, description="shadow mode: the arm whose answer clients get.")
    shadow_fraction: float = Field(1.0, ge=0, le=1, description="shadow mode: share of requests mirrored.")
    sticky_header: str = Field("x-dfserve-route-key", description="sticky mode: header holding the routing key; "
                               "the OpenAI `user` field is used when the header is absent.")
    shed: bool = Field(False, description="An arm with no healthy replica sends its share to the other arms "
                       "instead of answering 503.")

    @field_validator("arms")
    @classmethod
    def _names(cls, arms: dict[str, ArmConfig]) -> dict[str, ArmConfig]:
        for name in arms:
            if not ARM_NAME.fullmatch(name):
                raise ValueError(f"arm name {name!r}: use {ARM_NAME_RULE} (a label the dashboards, headers and --set "
                                 "paths all take)")
        return arms

    @field_validator("sticky_header")
    @classmethod
    def _header_name(cls, name: str) -> str:
        """No request can carry a header named `""` or `bad header:`: sticky mode would never find its key."""
        if not is_field_name(name):
            raise PydanticCustomError("header_name", "{name} is not an HTTP header name (letters, digits and "
                                      "!#$%&'*+-.^_`|~)", {"name": repr(name)})
        return name

    @model_validator(mode="after")
    def _mode(self) -> RoutingConfig:
        if self.mode == "shadow":
            if self.primary not in self.arms:
                raise ValueError(f"shadow mode needs primary: one of {sorted(self.arms)}")
            if len(self.arms) < 2:
                raise ValueError("shadow mode needs a second arm to mirror to")
        elif self.primary is not None:
            raise ValueError("primary is only used in shadow mode")
        elif sum(arm.weight for arm in self.arms.values()) <= 0:
            raise ValueError("at least one arm needs a positive weight")
        return self


def routing_version(routing: RoutingConfig) -> str:
    """A short hash of the routing's content: the same on every replica that runs the same routing, whatever the
    file's layout, comments or key order (`dfserve_gateway_routing_version`, `gateway.watch`)."""
    canonical = json.dumps(routing.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


class Limits(_Model):
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Larger request bodies get 413.")
    max_connections: int = Field(2048, gt=0, description="Client connections open at once; one more is answered "
                                 "503 and closed.")
    head_timeout_s: float = Field(10.0, gt=0, description="Time a client has to send a whole request head, from its "
                                  "first byte (from the connection's start for its first request); then 408 and close. "
                                  "Bytes that trickle in do not extend it.")
    body_timeout_s: float = Field(60.0, gt=0, description="Time a client has to send a whole request body, from the "
                                  "end of its head; then 408 and close.")
    idle_timeout_s: float = Field(75.0, gt=0, description="A kept-alive connection with no request under way is "
                                  "closed after this long; one whose client takes nothing of a whole answer for "
                                  "this long is cut off (its next request waits until it takes the answer).")
    max_concurrent_per_arm: int = Field(512, gt=0, description="Requests in flight per arm before 429.")
    connect_timeout_s: float = Field(3.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0, description="Longest wait for response headers (from the request, "
                                  "however their bytes trickle in) or the next chunk, and for a client that reads "
                                  "nothing of a stream.")
    max_retries: int = Field(2, ge=0, description="Other replicas of the same arm tried before the first byte.")
    max_event_bytes: int = Field(8 * 1024 * 1024, gt=0, description="Longest part of an upstream's server-sent "
                                 "event held while waiting for its end; past it the stream ends with an error event.")
    max_response_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Largest whole (not streamed) upstream "
                                    "response body, held until it is complete; past it the client gets 502.")


class HealthConfig(_Model):
    interval_s: float = Field(2.0, gt=0, description="Active GET /health per replica.")
    timeout_s: float = Field(5.0, gt=0, description="SGLang 0.5.23's /health generates a token and answers a "
                             "second later at the soonest (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, on by default): "
                             "a timeout of a second or less ejects healthy replicas.")
    eject_after_failures: int = Field(3, gt=0, description="Consecutive failures (active or passive) that eject.")
    max_ejection_percent: float = Field(50, ge=0, le=100, allow_inf_nan=False,
                                        description="Most of an arm's replicas that requests' failures may eject (at "
                                        "least one, never the last healthy one); health checks eject any.")
    path: str = Field("/health", pattern=r"^/[^\s#]*$", description="the replicas' health route, from /")


class ScrapeConfig(_Model):
    interval_s: float = Field(15.0, gt=0, allow_inf_nan=False, description="How often each replica's /metrics is "
                              "read.")
    window_s: float = Field(300.0, gt=0, description="Window of the per-arm acceptance figure.")
    timeout_s: float = Field(5.0, gt=0)
    enabled: bool = True


class AdminConfig(_Model):
    host: str = Field("127.0.0.1", description="Bind address of the admin listener.")
    port: int | None = Field(None, ge=0, le=65535, description="Admin listener port; no admin API when unset.")
    token_env: str = Field("DFSERVE_ADMIN_TOKEN", description="Environment variable holding the bearer token.")


class ObserverConfig(_Model):
    """One observer of finished exchanges (`gateway.observers`): a registered kind and its options."""

    kind: str = Field(description="A kind registered with `dfserve.gateway.observers.register`.")
    queue_size: int = Field(4096, gt=0, description="Exchanges waiting for the observer's thread; past it one is "
                            "dropped for this observer and counted (reason behind).")
    options: dict[str, Any] = Field(default_factory=dict, description="What the kind reads, as it documents.")


class GatewayConfig(_Model):
    """Everything `dfserve gateway` needs; `routing` is the part the admin API can replace at runtime."""

    schema_version: Literal[1] = 1
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    routing: RoutingConfig
    limits: Limits = Limits()
    health: HealthConfig = HealthConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    admin: AdminConfig = AdminConfig()
    seed: int | None = Field(None, description="Seed of the split's random choice; None draws one.")
    observers: tuple[ObserverConfig, ...] = Field((), strict=False, description="Observers of every finished "
                                                  "exchange besides metrics, each on a thread of its own.")
    watch_interval_s: float | None = Field(None, gt=0, description="Check the config file this often and apply "
                                           "its routing when it changes (`gateway.watch`); the admin API is then "
                                           "read-only. None: the file is read at start and on SIGHUP.")
    capture: CapturePolicy | None = Field(None, description="Capture clients' requests for replay "
                                          "(`dfserve.capture`); None: no capture.")
    shadow: ShadowPolicy | None = Field(None, description="shadow mode: record every mirrored request's answers "
                                        "from each arm, paired by request, for `dfserve compare`.")

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version(cls, version: Any) -> Any:
        """A `Literal` matches by equality, even in strict mode, and `True == 1.0 == 1`."""
        if type(version) is not int:
            raise PydanticCustomError("literal_error", "Input should be 1")
        return version

    @model_validator(mode="after")
    def _shadow(self) -> GatewayConfig:
        if (problem := shadow_problem(self.shadow, self.routing)) is not None:
            raise ValueError(problem)
        return self

    def admin_token(self, environ: dict[str, str] | None = None) -> str | None:
        """The admin bearer token, read from the environment so it never sits in a config file."""
        token = (os.environ if environ is None else environ).get(self.admin.token_env, "")
        if self.admin.port is not None and len(token) < 16:
            raise FieldError("admin.token_env", f"set {self.admin.token_env} to a token of at least 16 characters, "
                             "or leave admin.port unset")
        return token or None


def shadow_problem(shadow: ShadowPolicy | None, routing: RoutingConfig) -> str | None:
    """Why `routing` cannot carry shadow records as `shadow` asks, if it cannot (at start)."""
    if shadow is None:
        return None
    if routing.mode != "shadow":
        return "shadow: records are of mirrored requests; they need mode: shadow"
    secondary = shadow.secondary
    if secondary is not None and secondary not in routing.arms:
        return (f"shadow.secondary: {secondary!r} is not a mirrored arm "
                f"(arms: {', '.join(sorted(routing.arms))}, primary {routing.primary})")
    return floor_problem(shadow, routing)


def floor_problem(shadow: ShadowPolicy | None, routing: RoutingConfig) -> str | None:
    """Why `routing` would judge the noise floor against itself, if it would: the secondary arm made the primary, or
    served by one of the primary's replicas (its figures are then the primary's). Checked at start and for every
    routing a running gateway is given."""
    secondary = shadow.secondary if shadow is not None else None
    if secondary is None or secondary not in routing.arms:
        return None
    primary = routing.primary
    if secondary == primary:
        return f"shadow.secondary: {secondary!r} is the noise floor, and cannot be the primary"
    shared = sorted({endpoint(url) for url in routing.arms[secondary].replicas}
                    & {endpoint(url) for url in routing.arms[primary].replicas}) if primary in routing.arms else []
    if shared:
        return (f"shadow.secondary: arm {secondary!r} is served by the primary's replica {shared[0][1]}:{shared[0][2]}: "
                "its figures would be the primary's")
    return None


def moved_problem(shadow: ShadowPolicy | None, started: RoutingConfig, after: RoutingConfig) -> str | None:
    """Why a gateway started with shadow records cannot take `after`, if it cannot: a folder's config.json
    describes each arm's engines as the gateway started (their `/server_info`), and an arm moved to other replicas
    would have its records judged as the old engines' (a candidate pointed at the primary's engine passed as a
    drafter of its own). `started`, not the routing in force: an arm dropped and added again is the same arm."""
    if shadow is None:
        return None
    for name, arm in after.arms.items():
        if name in started.arms and {*map(endpoint, arm.replicas)} != {*map(endpoint, started.arms[name].replicas)}:
            return (f"routing.arms.{name}.replicas: shadow records describe each arm's engines as the gateway "
                    "started; restart it to record other replicas")
    return None


DEFAULT_PORTS = {"http": 80, "https": 443}


def endpoint(url: str) -> tuple[str, str, int | None]:
    """A replica's scheme, host and port as a server is reached: `HTTP://Host:80/` and `http://host` are one, and so
    are the spellings of one address (`localhost`, `127.1`, `::ffff:127.0.0.1` and `127.0.0.1`). Other names are
    not resolved: two names of one host are two hosts here."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # not a port (a config.json edited by hand): the scheme's, as none given
        port = None
    return scheme, _address(parts.hostname or ""), port if port is not None else DEFAULT_PORTS.get(scheme)


def _address(host: str) -> str:
    host = host.lower()
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            return socket.inet_ntoa(socket.inet_aton(host))  # IPv4's short forms: 127.1, 0x7f.1
        except OSError:
            return host
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


_ROUTING_KEYS = set(RoutingConfig.model_fields)


def _flatten(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Accept routing keys (mode, arms, ...) at the top level of the YAML file as well as under `routing:`; one key
    given in both places is refused, since either one winning would leave the other silently unused."""
    routing = dict(_mapping(raw.get("routing") or {}, where, "routing"))
    rest = {}
    for key, value in raw.items():
        if key in _ROUTING_KEYS:
            if key in routing:
                raise UserError(f"{where}: {key}: also given as routing.{key}; set it in one place")
            routing[key] = value
        elif key != "routing":
            rest[key] = value
    return {**rest, "routing": routing}


def _mapping(value: Any, where: str, field: str) -> dict[str, Any]:
    """`value` where the file must hold a mapping: `routing: 5` is refused naming the field, not a TypeError."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: {field}: expected a mapping, not {type(value).__name__} {value!r:.40}")
    return value


def parse_routing(raw: Any, where: str = "routing") -> RoutingConfig:
    """Validate a routing document (the admin API's PUT body); a `UserError` names the bad field."""
    try:
        return RoutingConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError(describe_invalid(exc, where)) from None


def load_config(path: Path | None, overrides: dict[str, Any], flags: Mapping[str, str] | None = None) -> GatewayConfig:
    """The config file (if any) with overrides applied (the CLI's flags); dotted keys (`admin.port`) reach nested
    fields. A `UserError` names the file and the field, or the flag that set it (`flags`: dotted key to flag)."""
    raw: dict[str, Any] = {}
    where = str(path) if path else "gateway config"
    if path is not None:
        loaded = read_yaml(path)
        if not isinstance(loaded, dict):
            raise UserError(f"{path}: expected a mapping at the top level")
        raw = _flatten(loaded, where)
    raw.setdefault("routing", {})
    for dotted, value in overrides.items():
        target = raw
        *parents, leaf = dotted.split(".")
        for depth, parent in enumerate(parents, 1):
            target = _mapping(target.setdefault(parent, {}), where, ".".join(parents[:depth]))
        target[leaf] = value
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        first = ".".join(str(part) for part in exc.errors()[0]["loc"])
        named = next(((key, flag) for key, flag in (flags or {}).items()
                      if key in overrides and (first == key or first.startswith(key + "."))), None)
        if named is not None:
            key, flag = named
            raise UserError(f"{flag}: {'' if first == key else first.removeprefix(key + '.') + ': '}"
                            f"{exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        within = [flag for key, flag in (flags or {}).items() if key in overrides and key.startswith(first + ".")]
        raise UserError(describe_invalid(exc, f"{where} with {', '.join(within)}" if within else where)) from None
