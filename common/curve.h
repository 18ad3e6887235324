/* CURVE keys for ZeroMQ endpoints (CurveZMQ, http://curvezmq.org; ZeroMQ RFC 26 and, for the
 * ZAP handler that checks client keys, RFC 27): key pairs, key files, and the loopback test
 * that decides whether an endpoint needs them.
 *
 * Keys travel and are stored in Z85 (ZeroMQ RFC 32): 40 printable characters for 32 bytes.
 * Key files (what `rlflow keygen --out PREFIX` writes, PREFIX.key and PREFIX.pub, and the list
 * of allowed client keys) are text: one key per line, as the first word of the line; anything
 * after the key and a blank is a free comment; blank lines are skipped, and so are lines whose
 * first word starts with '#' and is not 40 characters long ("# alice", "#laptop"). Z85 uses
 * '#' too, so a 40-character first word is always read as a key.
 *
 * Threads: every function is reentrant. */
#ifndef RF_CURVE_H
#define RF_CURVE_H

#include "common/status.h"

/* Characters of a Z85 key, without the terminating NUL. */
#define RF_CURVE_KEY_LEN 40

/* A Z85 key with its NUL. */
typedef char rf_curve_key[RF_CURVE_KEY_LEN + 1];

/* RF_OK when `key` is 40 Z85 characters that decode to 32 bytes; otherwise RF_ERR_ARG naming
 * `what` ("reward.external_curve_secret (server.key:1)") and what is wrong. */
rf_status rf_curve_check(const char *key, const char *what);

/* A fresh key pair (libsodium's RNG through zmq_curve_keypair). Errors: RF_ERR_UNSUPPORTED
 * when libzmq was built without CURVE. */
rf_status rf_curve_keypair(rf_curve_key pub, rf_curve_key secret);

/* The public key of a secret key. Errors: RF_ERR_ARG for a malformed key, RF_ERR_UNSUPPORTED
 * without CURVE support. */
rf_status rf_curve_public(const char *secret, rf_curve_key pub);

/* Reads the one key of the key file at `path`. With `secret` set, a file that other users may
 * read gets a warning (chmod 600). Errors (RF_ERR_IO unreadable, RF_ERR_ARG malformed, no key
 * or more than one) name the file and line. */
rf_status rf_curve_read_key(const char *path, int secret, rf_curve_key key);

/* Reads every key of a key list (allowed client public keys). *keys (n) is the caller's to
 * free(); duplicates are kept once. Errors name the file and line; an empty list is an error
 * (it would refuse everybody). */
rf_status rf_curve_read_keys(const char *path, rf_curve_key **keys, int *n);

/* Writes PREFIX.key (the secret key, mode 0600) and PREFIX.pub (the public key, 0644), each one
 * line; *pub receives the public key. Existing files are an error unless `force`. */
rf_status rf_curve_write_keypair(const char *prefix, int force, rf_curve_key pub);

/* 1 when `endpoint` is reachable from this machine only: ipc://, inproc://, or tcp:// bound to
 * a loopback address (127.0.0.0/8, ::1, "localhost", the "lo" interface); 0 for every other
 * endpoint: the wildcard host "*", "tcp://0.0.0.0:5557", "tcp://eth0:5557", "tcp://10.0.0.5:5557". */
int rf_curve_endpoint_is_local(const char *endpoint);

#endif
