"""Test doubles shipped with bpdkv (for its own tests and benchmarks, and for users testing their routing): the vLLM emulator.

The local lab of real SSH hosts and the tiny model are product, in `bpdkv.lab`."""
