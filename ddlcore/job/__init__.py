"""Joining a job: the rendezvous (who is rank 0, where its store listens, the job's secret), the
store and its wire format, authentication, the bootstrap that builds a communicator's parts,
the links (which transport carries each peer pair) and the link probe."""
