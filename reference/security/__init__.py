"""Who may speak on the control plane (docs/SECURITY.md): only the job's members reach its
store, and every value they put is sealed.

- :mod:`.secret`: the job secret (:class:`~weight_transfer.security.secret.JobSecret`), the keys
  and certificates derived from it, the sealing of values (AES-SIV), the warning of the one
  opt-out;
- :mod:`.store_server`: the store's server (mutual TLS, the frames both sides speak);
- :mod:`.secure_store`: its client, a ``torch.distributed.Store``.

Crypto comes from ``cryptography``; nothing received is unpickled.

Imports: ``errors``.
"""
