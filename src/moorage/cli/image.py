"""``moorage image``: build, inspect and prune the micro-VM guest images (cached by recipe hash).

The first build runs debootstrap (a minute or two); later builds reuse every cached layer.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Optional

import typer

from moorage.cli.console import make_console
# moorage.sandbox.image is imported by each command: every other command of the CLI would pay for it.

app = typer.Typer(no_args_is_help=True, help="Guest images for micro-VM sandboxes.")
console = make_console()
err_console = make_console(stderr=True)


def _images_dir(override: Optional[Path]) -> Path:
    from moorage.cli.main import state

    return override or state.cfg.images_dir


@app.command()
def build(
    force: bool = typer.Option(False, "--force", help="Rebuild every layer, ignoring the cache."),
    images_dir: Optional[Path] = typer.Option(None, "--images-dir", help="Image cache (default: <data dir>/images)."),
    as_json: bool = typer.Option(False, "--json", help="Print the image manifest as JSON."),
) -> None:
    """Build the guest image (kernel, initramfs, root filesystem with the moorage guest runtime), or reuse it."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from moorage.sandbox.image import ImageBuilder

    started = time.monotonic()
    # Progress goes to stderr: stdout holds only the result (with --json, the manifest and nothing else).
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[step]:<10}[/] {task.description}"), TimeElapsedColumn(),
                  console=err_console, transient=as_json) as progress:
        task = progress.add_task("starting", step="image")

        def report(step: str, detail: str) -> None:
            progress.update(task, description=detail, step=step)
            if not as_json:
                progress.console.print(f"  {step:<10} {detail}", highlight=False)

        img = ImageBuilder(_images_dir(images_dir), progress=report).build(force=force)
    if as_json:
        print(json.dumps(img.to_json(), indent=2))
        return
    console.print(f"[green]image {img.id}[/] ready in {time.monotonic() - started:.1f} s: kernel {img.kernel_version}, root {img.disk_mib} MiB at {img.dir}", highlight=False)


@app.command("list")
def list_images(images_dir: Optional[Path] = typer.Option(None, "--images-dir",
                                                          help="Image cache (default: <data dir>/images)."),
                as_json: bool = typer.Option(False, "--json", help="Each image's manifest, with whether it is current.")) -> None:
    """Images in the cache; the one matching the current recipe and guest code is marked."""
    from moorage.sandbox.image import GuestImage, ImageBuilder

    d = _images_dir(images_dir)
    current = ImageBuilder(d).image_id()
    found = sorted((p for p in d.glob("*/manifest.json")), key=lambda p: p.stat().st_mtime) if d.exists() else []
    if as_json:
        images = [GuestImage.load(m.parent) for m in found]
        print(json.dumps({"data": [{**img.to_json(), "current": img.id == current} for img in images]}, indent=2))
        return
    if not found:
        console.print(f"no images under {d}; run `moorage image build`")
        return
    for m in found:
        img = GuestImage.load(m.parent)
        mark = "[green]*[/]" if img.id == current else " "
        console.print(f"{mark} {img.id}  kernel {img.kernel_version}  built {time.strftime('%Y-%m-%d %H:%M', time.localtime(img.built_at))}", highlight=False)


@app.command()
def prune(
    images_dir: Optional[Path] = typer.Option(None, "--images-dir", help="Image cache (default: <data dir>/images)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be removed."),
) -> None:
    """Remove images other than the current one. Sandboxes keep a reference to their image: prune only images
    no sandbox was created from (moorage checks the sandboxes directory of this data dir)."""
    from moorage.cli.main import state
    from moorage.sandbox.image import ImageBuilder

    d = _images_dir(images_dir)
    current = ImageBuilder(d).image_id()
    in_use = {current}
    sandboxes = state.cfg.sandboxes_dir
    if sandboxes.exists():
        for meta in list(sandboxes.glob("*/meta.json")) + list(sandboxes.glob(".templates/*/template.json")):
            try:
                in_use.add(json.loads(meta.read_text()).get("image_id"))
            except (OSError, ValueError):
                continue
    for m in d.glob("*/manifest.json") if d.exists() else []:
        if m.parent.name in in_use:
            continue
        console.print(f"{'would remove' if dry_run else 'removing'} {m.parent}", highlight=False)
        if not dry_run:
            shutil.rmtree(m.parent)
