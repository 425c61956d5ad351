"""Joining a job: the rendezvous (who is rank 0, where its store listens, the job's secret), the
store and its wire format, the links (which transport carries each peer pair), the link probe,
CPU placement, abort notes, and the rank's half of ddlrun's failure pipe. `ddlcore.bootstrap`
puts these together into a communicator; the handshake they authenticate with is
`ddlcore.security`'s."""
