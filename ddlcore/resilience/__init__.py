"""Surviving a rank's death: the control plane every process of a job opens at init
(`control.ControlPlane`: connections that outlive the communicators, and the failure detector),
and the fault-tolerant protocols over it, starting with agreement (`agree`, run per
communicator by `channel.AgreeChannel`)."""
