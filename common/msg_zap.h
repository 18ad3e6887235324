/* The ZAP handler of a CURVE message server (common/msg.c): ZeroMQ's authentication protocol
 * (ZAP, RFC 27) on inproc://zeromq.zap.01, answered from a thread of its own so that CURVE
 * handshakes complete in milliseconds whether or not the server's owner is polling (rlflow may
 * train for minutes between two polls of its reward endpoint; a handshake that waited for the
 * poll would time out in ZeroMQ and look like a key error to the client).
 *
 * A client whose CURVE public key is on the list gets status 200, any other 400. Refusals are
 * queued as sentences naming the endpoint, the peer's address and its key (the same one at most
 * once per 10 s: a refused DEALER reconnects every 100 ms by itself); the server pops them and
 * reports them as RF_MSG_EV_REFUSED events.
 *
 * Threads: start, pop and stop from the server's thread; the handler thread owns its socket. */
#ifndef RF_MSG_ZAP_H
#define RF_MSG_ZAP_H

#include <stddef.h>

#include "common/curve.h"
#include "common/status.h"

typedef struct rf_msg_zap rf_msg_zap;

/* Binds inproc://zeromq.zap.01 in ctx (one handler per ZeroMQ context) and starts the thread.
 * `keys` (n >= 1, checked Z85) are copied; `endpoint` names the server in messages. Bind before
 * the server's socket accepts connections: libzmq lets every CURVE client in while no handler
 * is bound. Caller owns *z (rf_msg_zap_stop). Errors: RF_ERR_IO (bind, thread), naming the
 * endpoint; RF_ERR_NOMEM. */
rf_status rf_msg_zap_start(rf_msg_zap **z, void *ctx, const char *endpoint,
                           const rf_curve_key *keys, int n);

/* Names the server in messages from now on (the bound endpoint, once "tcp://host:*" has its
 * port). */
void rf_msg_zap_set_endpoint(rf_msg_zap *z, const char *endpoint);

/* Moves the oldest pending refusal into text (cap bytes) and returns 1; 0 when none. */
int rf_msg_zap_refusal(rf_msg_zap *z, char *text, size_t cap);

/* Stops the thread (within 0.1 s), closes its socket, frees z. NULL is fine. Call before the
 * context is terminated. */
void rf_msg_zap_stop(rf_msg_zap *z);

#endif
