"""Who may talk to a job: its secret (`secret`), what a connecting end claims (`claims`) and
the handshake that proves both (`auth`). Below the transports and the store, which both run
the handshake, and above nothing but the errors and the configuration."""
