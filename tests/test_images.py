"""tool.images: the one rule for "this local image is the recipe's pin", which `tool up` (docker CLI) and
preflight (Docker SDK) both apply to the RepoDigests they read."""
from tool.images import pinned_name, present_by_digest, short

DIGEST = "sha256:" + "ab" * 32


def test_a_tag_before_the_digest_is_dropped_and_a_registry_port_kept():
    assert pinned_name(f"registry:5000/org/app:1.2@{DIGEST}") == f"registry:5000/org/app@{DIGEST}"
    assert pinned_name(f"registry:5000/org/app@{DIGEST}") == f"registry:5000/org/app@{DIGEST}"


def test_only_a_repo_digest_equal_to_the_pin_counts():
    image = f"ghcr.io/org/app:latest@{DIGEST}"
    assert present_by_digest([f"ghcr.io/org/app@{DIGEST}"], image)
    assert not present_by_digest([f"ghcr.io/other/app@{DIGEST}"], image)          # same digest, other repo
    assert not present_by_digest([f"ghcr.io/org/app@sha256:{'cd' * 32}"], image)  # the tag moved
    assert not present_by_digest(None, image) and not present_by_digest([], image)


def test_the_short_form_names_the_repo_and_the_digest_head():
    assert short(f"org/app:1@{DIGEST}") == f"org/app@{DIGEST[:19]}…"
