"""Sizing of an agent's sandbox: ``memory_mib``, ``vcpus`` and ``disk_mib`` from its ``[agent]`` table.

The manifest's values are checked for shape at validation (``check_manifest_sizing``) and against what this
host can give when the template is built (``spec_for``); the template's spec is what every fork inherits.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from moorage.config import Config
from moorage.cpus import usable_cpus
from moorage.errors import DiskFull, InvalidInput
from moorage.sandbox import SandboxSpec

#: Bounds any host applies before looking at itself (a typo such as 40960000 fails with a clear message).
MIN_MEMORY_MIB = 128
MAX_MEMORY_MIB = 1 << 20
MAX_VCPUS = 256
MAX_DISK_MIB = 1 << 24
#: Ports an agent may serve its own app on (``[agent] ports``).
MAX_PORTS = 8
#: Memory the host keeps for itself, QEMU's own overhead and the API: an agent may not ask for all of it.
HOST_RESERVE_MIB = 256


class AgentSizingError(InvalidInput):
    """The agent asks for more (or less) than this host can give its sandbox; nothing was deployed."""

    code = "agent-sizing"


def _int_field(agent: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = agent.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise AgentSizingError(f"moorage.toml: {name} must be a whole number, not {value!r}",
                               hint=f"write e.g. {name} = {low if low > 1 else 2}")
    if not low <= value <= high:
        raise AgentSizingError(f"moorage.toml: {name} = {value} is out of range ({low}..{high})",
                               hint="fix the file and deploy again; nothing was changed")
    return value


def check_manifest_sizing(agent: Mapping[str, Any]) -> None:
    """Shape checks that need no host: whole numbers in sane ranges, a list of distinct TCP ports."""
    _int_field(agent, "memory_mib", MIN_MEMORY_MIB, MAX_MEMORY_MIB)
    _int_field(agent, "vcpus", 1, MAX_VCPUS)
    _int_field(agent, "disk_mib", 1, MAX_DISK_MIB)
    app_ports(agent)


def app_ports(agent: Mapping[str, Any]) -> list[int]:
    """The ports the agent serves its web app on (``[agent] ports``); the first one is ``/app/``."""
    ports = agent.get("ports", [])
    if not isinstance(ports, list) or len(ports) > MAX_PORTS or not all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports) \
            or len(set(ports)) != len(ports):
        raise AgentSizingError(f"moorage.toml: ports must be a list of at most {MAX_PORTS} distinct TCP ports",
                               hint="write e.g. ports = [8080]")
    return list(ports)


def host_memory_mib() -> int:
    """The host's physical memory (MemTotal), MiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20


def spec_for(agent: Mapping[str, Any], config: Config, sandboxes_root: Path) -> SandboxSpec:
    """The sandbox spec for an agent's template, or ``AgentSizingError`` saying what this host cannot give."""
    check_manifest_sizing(agent)
    base = SandboxSpec()
    memory = agent.get("memory_mib", config.guest_memory_mib)
    vcpus = agent.get("vcpus", base.vcpus)
    disk = agent.get("disk_mib", base.disk_mib)

    mem_cap = max(MIN_MEMORY_MIB, host_memory_mib() - HOST_RESERVE_MIB)
    mem_why = f"this host has {host_memory_mib()} MiB of memory and keeps {HOST_RESERVE_MIB} MiB for itself"
    if config.agent_max_memory_mib and config.agent_max_memory_mib < mem_cap:
        mem_cap, mem_why = config.agent_max_memory_mib, f"the operator's limit is {config.agent_max_memory_mib} MiB (agent_max_memory_mib)"
    if memory > mem_cap:
        raise AgentSizingError(f"memory_mib = {memory} is more than this host can give one agent: {mem_why}",
                               hint=f"use memory_mib <= {mem_cap} and deploy again; nothing was changed")

    cpu_cap = usable_cpus()  # its affinity, narrowed by a container's or unit's CPU quota
    cpu_why = f"this host has {cpu_cap} CPUs"
    if config.agent_max_vcpus and config.agent_max_vcpus < cpu_cap:
        cpu_cap, cpu_why = config.agent_max_vcpus, f"the operator's limit is {config.agent_max_vcpus} (agent_max_vcpus)"
    if vcpus > cpu_cap:
        raise AgentSizingError(f"vcpus = {vcpus} is more than this host can give one agent: {cpu_why}",
                               hint=f"use vcpus <= {cpu_cap} and deploy again; nothing was changed")

    root = sandboxes_root if sandboxes_root.exists() else next(
        (p for p in sandboxes_root.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(root).free >> 20
    if free < 1:  # no agent is too big: the disk is full (a size to ask for would be "<= 0")
        raise DiskFull("the host is out of disk space: the deploy was not carried out (nothing was changed)")
    disk_cap, disk_why = free, f"the disk under {root} has {free} MiB free"
    if config.agent_max_disk_mib and config.agent_max_disk_mib < disk_cap:
        disk_cap, disk_why = config.agent_max_disk_mib, f"the operator's limit is {config.agent_max_disk_mib} MiB (agent_max_disk_mib)"
    if disk > disk_cap:
        raise AgentSizingError(f"disk_mib = {disk} is more than this host can give one agent: {disk_why}",
                               hint=f"use disk_mib <= {disk_cap} (the agent's own space, on top of the guest image) "
                                    "and deploy again; nothing was changed")
    from moorage.runtime.vm_network import guest_env

    # An agent with [agent.network] gets its proxy relay and HTTP(S)_PROXY in every process of its sandbox.
    return SandboxSpec(memory_mib=memory, vcpus=vcpus, disk_mib=disk, env=guest_env(agent))
