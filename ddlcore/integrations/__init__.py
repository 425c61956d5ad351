"""Framework integrations: thin layers over the public `Communicator` API.

Each integration lives in its own module and imports its framework lazily, so ``import ddlcore``
never needs one: ``ddlcore.integrations.torch`` (``pip install 'ddlcore[torch]'``) has the DDP
communication hooks, the Horovod-style `DistributedOptimizer` and the parameter and
optimizer-state broadcasts.
"""
