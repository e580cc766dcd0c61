"""Key agreement of secure aggregation: X25519, then one BLAKE2b hash per pair and purpose.

Each client draws two X25519 key pairs a round: c (the keys that encrypt Shamir shares to a
neighbour) and s (the keys whose agreements seed the pairwise masks). `agree` gives the 32-byte
key both ends of a pair derive for one purpose (`MASK` or `SHARES`).
"""

from __future__ import annotations

import functools
import hashlib

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = ["MASK", "SHARES", "agree", "public_key"]


@functools.lru_cache(maxsize=4096)
def public_key(raw: bytes) -> X25519PublicKey:
    """A public key parsed once per process (public data: sharing it across simulated clients
    reveals nothing, and parsing costs a sixth of an agreement)."""
    return X25519PublicKey.from_public_bytes(raw)


def agree(private: X25519PrivateKey, own: bytes, public: bytes, purpose: bytes) -> bytes:
    """The 32-byte key both ends of a pair derive for `purpose`: one BLAKE2b-256 hash (RFC 7693)
    personalised with `purpose`, of the X25519 shared secret followed by the pair's two public
    keys in byte order (`own` is this end's, `public` the other's).

    Why a hash and not HKDF: Bonawitz et al. 2017 (sec. 3, "Key Agreement") instantiate
    KA.agree as Diffie-Hellman followed by a hash of the shared secret, and RFC 7748 (sec. 6.1)
    says to pass K = X25519(a, B) to a KDF "that includes K, K_A, and K_B", as libsodium's
    crypto_kx does with BLAKE2b over K || K_A || K_B. The public keys bind the key to this pair
    and this round (every round draws fresh keys); the personalisation separates the two
    purposes, which use different key pairs anyway (c for shares, s for masks: merging those
    would let a server that calls a live client dropped learn its mask key and its seed). One
    hash costs about 0.4 us here against 3 us for HKDF's two HMACs."""
    shared = private.exchange(public_key(public))
    context = own + public if own < public else public + own
    return hashlib.blake2b(shared + context, digest_size=32, person=purpose).digest()


MASK = b"tessera-sa-mask"  # BLAKE2b personalisations (at most 16 bytes)
SHARES = b"tessera-sa-share"
