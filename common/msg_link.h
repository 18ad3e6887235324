/* A worker's connection to the controller, served by a background thread: the thread owns the
 * ZeroMQ socket, answers the controller's pings while the worker computes (a training step or
 * a decode step may take longer than the heartbeat interval), sends what the worker queues and
 * queues what arrives. A controller that sends nothing (not even a ping) for peer_timeout_s
 * is reported lost to the worker, naming its endpoint.
 *
 * Threads: rf_msg_link_send / recv / close from one owning thread; the link's own thread is
 * internal. */
#ifndef RF_MSG_LINK_H
#define RF_MSG_LINK_H

#include "common/msg.h"

typedef struct rf_msg_link rf_msg_link;

/* Connects with Hello (as rf_msg_client_connect) and starts the thread. peer_timeout_s > 0 is
 * the silence limit for the controller. */
rf_status rf_msg_link_open(rf_msg_link **l, const rf_msg_client_config *cfg, double peer_timeout_s);

/* Queues one message for sending (encoded now; sent by the thread within milliseconds).
 * Errors: the link failed earlier (its message), RF_ERR_NOMEM. */
rf_status rf_msg_link_send(rf_msg_link *l, rf_msg_type type, const ProtobufCMessage *m);

/* The next received message, waiting at most timeout_s (0: no wait): *got = 1 and *out set
 * (caller frees), or *got = 0. Errors: the controller went silent, the connection failed, or
 * a frame did not decode (the message says which). */
rf_status rf_msg_link_recv(rf_msg_link *l, double timeout_s, rf_msg *out, int *got);

/* 1 once a Shutdown has arrived (queued or taken) or the link failed: long waits elsewhere
 * (a transfer to a peer that is gone) should give up. */
int rf_msg_link_shutdown_seen(rf_msg_link *l);

/* Waits (at most timeout_s) until every queued message has been handed to ZeroMQ. */
rf_status rf_msg_link_flush(rf_msg_link *l, double timeout_s);

/* A worker that failed (st, message recorded) tells the controller why, so that the run stops
 * naming it: an Error on *l, then a flush (5 s at most). A worker that failed before it
 * connected (*l NULL) first connects as cfg says only for this, waiting at most
 * min(peer_timeout_s, 5) s (a controller that is up answers at once; one that stopped never
 * does), else the controller would wait async.startup_timeout for it. Best effort; the
 * recorded message is kept. */
void rf_msg_link_tell_error(rf_msg_link **l, const rf_msg_client_config *cfg, double peer_timeout_s, rf_status st);

/* Stops the thread, sends what is queued (bounded linger), closes. NULL is fine. */
void rf_msg_link_close(rf_msg_link *l);

#endif
