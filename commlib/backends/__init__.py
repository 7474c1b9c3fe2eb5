"""Backends: the engines under commlib's narrow waist (see ``_base`` for the protocol).

Only ``mpi`` imports mpi4py; only the nccl backend (when it lands) imports cupy.
"""
