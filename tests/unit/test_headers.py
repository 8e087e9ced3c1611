"""probes.headers: BCC gets headers through BCC_KERNEL_SOURCE; nothing is written under /lib/modules
(a fake tree here), and only links an earlier version made there are removed."""

from __future__ import annotations

import os
from pathlib import Path

from evidence.probes import headers as h


def _distro(src: Path, version: str = "6.1.0-56") -> tuple[Path, Path]:
    flavour = src / f"linux-headers-{version}-cloud-amd64"
    common = src / f"linux-headers-{version}-common"
    (common / "include" / "linux").mkdir(parents=True)
    (common / "include" / "linux" / "types.h").write_text("/* common */\n")
    (common / "Makefile").write_text("common\n")
    (flavour / "include" / "config").mkdir(parents=True)
    (flavour / "include" / "config" / "kernel.release").write_text(f"{version}-cloud-amd64\n")
    (flavour / "Makefile").write_text("flavour\n")
    return flavour, common


def _snapshot(root: Path) -> list[tuple[str, str]]:
    return sorted(
        (str(p.relative_to(root)), os.readlink(p) if p.is_symlink() else "") for p in root.rglob("*")
    )


def test_distro_headers_are_joined_and_given_through_the_environment(tmp_path: Path) -> None:
    src, modules, farm_root = tmp_path / "src", tmp_path / "modules", tmp_path / "state"
    modules.mkdir()
    flavour, common = _distro(src)
    _distro(src, "6.1.0-12")  # an older pair is not chosen
    env: dict[str, str] = {}
    got = h.ensure_headers(modules, src, farm_root, env)
    assert got.via == h.ENV and got.headers == "6.1.0-56-cloud-amd64" and not got.match
    farm = Path(env[h.ENV])
    assert got.path == str(farm) and farm.parent == farm_root
    # one tree: the common files and the flavour's, the flavour winning where both have a file
    assert (farm / "include/linux/types.h").resolve() == (common / "include/linux/types.h")
    assert (farm / "include/config/kernel.release").resolve() == flavour / "include/config/kernel.release"
    assert (farm / "Makefile").read_text() == "flavour\n"
    assert _snapshot(modules) == []  # nothing under /lib/modules
    # made once: a second call reuses it
    again: dict[str, str] = {}
    assert h.ensure_headers(modules, src, farm_root, again).path == str(farm) and again[h.ENV] == str(farm)


def test_the_kernels_own_headers_are_used_in_place(tmp_path: Path) -> None:
    src, modules = tmp_path / "src", tmp_path / "modules"
    _distro(src)
    build = modules / os.uname().release / "build"
    (build / "include" / "config").mkdir(parents=True)
    (build / "include" / "config" / "kernel.release").write_text(os.uname().release)
    env: dict[str, str] = {}
    got = h.ensure_headers(modules, src, tmp_path / "state", env)
    assert got.via == "modules" and got.match and h.ENV not in env
    assert not (tmp_path / "state").exists()


def test_only_links_an_earlier_version_made_are_removed(tmp_path: Path) -> None:
    src, modules = tmp_path / "src", tmp_path / "modules"
    flavour, common = _distro(src)
    release = "6.18.0-test"
    kdir = modules / release
    kdir.mkdir(parents=True)
    (kdir / "build").symlink_to(flavour)
    (kdir / "source").symlink_to(common)
    assert sorted(p.name for p in h.remove_old_links(release, modules, src)) == ["build", "source"]
    assert not kdir.exists()  # the directory it made for them goes too, when empty

    other = modules / "6.18.1-test"
    other.mkdir(parents=True)
    (other / "build").symlink_to(tmp_path / "someone-elses-headers")  # DKMS, a user: not ours
    (other / "source").symlink_to(common)
    (other / "modules.dep").write_text("")
    assert [p.name for p in h.remove_old_links("6.18.1-test", modules, src)] == ["source"]
    assert (other / "build").is_symlink() and (other / "modules.dep").exists()


def test_no_headers_at_all(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    got = h.ensure_headers(tmp_path / "modules", tmp_path / "src", tmp_path / "state", {})
    assert got.path is None and got.via == "none"
