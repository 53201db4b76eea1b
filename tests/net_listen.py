"""Which TCP addresses a process listens on, from /proc (Linux): for tests that check nothing listens beyond loopback."""

from __future__ import annotations

import os
import socket


def listening_ports_of(pid: int) -> dict[int, str]:
    """port -> address of every listening TCP socket the process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with_target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.islink(f"/proc/{pid}/fd/{fd}") else ""
        if with_target.startswith("socket:["):
            inodes.add(with_target[8:-1])
    ports = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{name}") as table:
            for line in list(table)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:
                    continue
                address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                ports[int(hex_port, 16)] = socket.inet_ntop(family, raw)
    return ports
