"""Execution: the engines that run a schedule over the links (threads on the host, CUDA streams on
the device), the pipeline of the host-staged path, integer averaging, device-buffer staging,
and the execution paths (`ddlcore.execution.paths`) a communicator chooses from."""
