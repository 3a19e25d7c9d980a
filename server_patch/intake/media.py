"""Which media references a client may make the server read: no private hosts, no local files.

Stock mlx-vlm fetches any ``http(s)`` URL a request names as an image, video or audio (a
link-local cloud metadata address included: a server-side request forgery) and opens any local
path (``/etc/...``, the admin token file). By default this policy refuses, before any
connection is made:

* URLs whose host resolves to an address that is not globally routable (loopback, private,
  link-local, shared, reserved, multicast), unless ``APC_MEDIA_PRIVATE_URLS=1``;
* local paths and ``file://`` URLs outside ``APC_ALLOWED_LOCAL_MEDIA_PATH`` (vLLM's
  ``--allowed-local-media-path``; unset: none), symlinks resolved;
* other URL schemes. ``data:`` URIs are always fine.

The body guard applies it to every reference it finds in a request (a 400); mlx-vlm's image
loader applies it again at the fetch, to every redirect hop too (stock follows redirects), so
a shape the guard does not know still cannot reach a private host. What remains: a hostname
whose DNS answer changes between the check and the connection (rebinding).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import urljoin, urlsplit
from urllib.request import url2pathname

PRIVATE_ENV = "APC_MEDIA_PRIVATE_URLS"
LOCAL_ENV = "APC_ALLOWED_LOCAL_MEDIA_PATH"
MAX_REDIRECTS = 5

# Keys whose string value (or ``{"url": ...}``) names media, in mlx-vlm 0.7.10's request shapes
# (chat, responses, messages, embeddings, rerank, speech).
MEDIA_KEYS = frozenset({"image_url", "image", "video_url", "video", "audio_url", "ref_audio"})
# Content parts whose ``url``/``path``/``file_id`` name media (Anthropic's ``source.url`` too).
MEDIA_TYPES = frozenset({"image_url", "input_image", "image", "video_url", "input_video", "video",
                         "input_audio", "audio"})
REFERENCE_KEYS = frozenset({"url", "path", "file_id"})
# ``input_audio.data`` is read as a path or URL when it looks like one (openai.py:107-108).
_AUDIO_PREFIXES = ("http://", "https://", "file://", "/", "./", "../")
_AUDIO_SUFFIXES = (".wav", ".mp3", ".flac", ".ogg", ".m4a", ".aac", ".webm")

Resolver = Callable[..., list]


@dataclass(frozen=True)
class MediaPolicy:
    private_urls: bool = False
    local_root: str | None = None  # a realpath, or None: no local files at all

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "MediaPolicy":
        from server_patch import settings

        root = settings.value(LOCAL_ENV, env)
        return cls(private_urls=bool(settings.value(PRIVATE_ENV, env)),
                   local_root=os.path.realpath(os.path.expanduser(str(root))) if root else None)


@functools.cache
def current() -> MediaPolicy:
    """This server's policy (read once; a bad value stops the server at install)."""
    return MediaPolicy.from_env()


def references(data: Any) -> Iterator[str]:
    """Every string in a parsed request body that mlx-vlm would load as media."""
    stack = [(data, False)]
    while stack:
        node, inside = stack.pop()
        if isinstance(node, list):
            stack.extend((child, inside) for child in node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")  # any JSON: a JSON-Schema "type" may be a list or an object
        media = inside or (isinstance(kind, str) and kind in MEDIA_TYPES)
        for key, value in node.items():
            if isinstance(value, str):
                if key in MEDIA_KEYS or (media and key in REFERENCE_KEYS):
                    yield value
            elif isinstance(value, (dict, list)):
                if key == "input_audio" and isinstance(value, dict) and _audio_reference(value.get("data")):
                    yield value["data"]
                stack.append((value, media or key in MEDIA_KEYS))


def _audio_reference(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    text = value.strip()
    return text.startswith(_AUDIO_PREFIXES) or text.lower().endswith(_AUDIO_SUFFIXES)


def refusal(reference: str, policy: MediaPolicy, resolve: Resolver = socket.getaddrinfo) -> str | None:
    """Why ``reference`` may not be loaded (a sentence naming the setting that allows it), or None."""
    text = reference.strip()
    if text.startswith("data:"):
        return None
    try:
        parts = urlsplit(text)
    except ValueError:  # e.g. an unclosed "[" of an IPv6 host
        return f"media reference {reference[:200]!r} is not a valid URL"
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return _url_refusal(text, parts, policy, resolve)
    if scheme == "file":
        return local_refusal(url2pathname(parts.path), policy)
    if len(scheme) > 1:  # one letter is a Windows drive
        return f"media URL scheme {scheme!r} is not supported (use http(s), data: or an allowed local path)"
    return local_refusal(text, policy)


def _url_refusal(url: str, parts: Any, policy: MediaPolicy, resolve: Resolver) -> str | None:
    if policy.private_urls:
        return None
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return f"media URL {url!r} has a bad port"
    if not host:
        return f"media URL {url!r} names no host"
    try:
        answers = resolve(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError):  # UnicodeError (an IDNA label) is a ValueError
        return f"media URL host {host!r} does not resolve"
    for answer in answers:
        address = ipaddress.ip_address(str(answer[4][0]).split("%", 1)[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_global or address.is_multicast:
            return (f"media URL host {host!r} is a private, loopback or link-local address ({address}); "
                    f"set {PRIVATE_ENV}=1 to allow such hosts")
    return None


def local_refusal(path: str | os.PathLike[str], policy: MediaPolicy) -> str | None:
    """Why a local file may not be read: outside the allowed directory, or none allowed."""
    if policy.local_root is None:
        return f"local media paths are not accepted; set {LOCAL_ENV} to a directory to allow files in it"
    try:
        real = os.path.realpath(os.path.expanduser(os.fspath(path)))
    except ValueError:  # a NUL character, a lone surrogate: no file has that name
        return "local media path is not a valid file name"
    if os.path.commonpath([real, policy.local_root]) != policy.local_root:
        return f"local media path is outside {LOCAL_ENV} ({policy.local_root})"
    return None


def check_local(path: str | os.PathLike[str]) -> None:
    """The image loader's own check of a local path (a ValueError, as the loader raises)."""
    why = local_refusal(path, current())
    if why:
        raise ValueError(why)


def fetch(url: str, timeout: float) -> bytes:
    """GET ``url`` as stock's loader does, but every hop (redirects included) passes the policy."""
    import requests

    for _ in range(MAX_REDIRECTS + 1):
        why = refusal(url, current())
        if why:
            raise ValueError(why)
        with requests.get(url, stream=True, timeout=timeout, allow_redirects=False) as response:
            if response.is_redirect:
                url = urljoin(url, response.headers["location"])
                continue
            response.raise_for_status()
            return response.content
    raise ValueError(f"media URL redirected more than {MAX_REDIRECTS} times")
