"""Hosts a TCPStore master until killed: the server of the TorchStore fault tests.

    python _store_tcp_master.py

Prints the port, then sleeps; the test SIGSTOPs, SIGCONTs and SIGKILLs it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    print(store.port, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
