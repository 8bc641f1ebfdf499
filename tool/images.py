"""Container images pinned by digest: the one rule for "this local image is the recipe's pin".

A recipe names its image as repo[:tag]@sha256:…; a local image is the pin only when one of its
RepoDigests is exactly repo@sha256:… (a tag can move and an image ID is not what the registry
signed). `tool up` reads RepoDigests through the plan's docker client, preflight through the Docker
SDK; both decide here.
"""
from __future__ import annotations

from collections.abc import Iterable


def pinned_name(image: str) -> str:
    """'registry:5000/org/app:1.2@sha256:ab…' → 'registry:5000/org/app@sha256:ab…' (the tag dropped, not the port)."""
    repo, _, digest = image.partition("@")
    if ":" in repo.rsplit("/", 1)[-1]:
        repo = repo.rsplit(":", 1)[0]
    return f"{repo}@{digest}"


def present_by_digest(repo_digests: Iterable[str] | None, image: str) -> bool:
    return pinned_name(image) in (repo_digests or ())


def short(image: str) -> str:
    """The pin as a person reads it: repo@sha256:<12 hex>…"""
    name = pinned_name(image)
    repo, _, digest = name.partition("@")
    return f"{repo}@{digest[:19]}…"
