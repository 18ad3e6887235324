/* The worker link: one thread owns the client socket (ZeroMQ sockets are not thread safe); the
 * owner talks to it through two locked queues and a pipe that wakes it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/msg_link.h"
#include "common/util.h"

typedef struct frame {
    uint8_t *buf;
    size_t len;
    struct frame *next;
} frame;

typedef struct inmsg {
    rf_msg m;
    struct inmsg *next;
} inmsg;

struct rf_msg_link {
    rf_msg_client *c;
    pthread_t thread;
    int started;
    int wake[2]; /* pipe: the owner writes a byte when it queues a frame or wants the thread to stop */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    frame *out_head, *out_tail;
    inmsg *in_head, *in_tail;
    int stop, failed, sending, shutdown_seen;
    char err[1024];
    rf_status err_code;
    double peer_timeout;
    char endpoint[256];
};

static void fail(rf_msg_link *l, rf_status code, const char *msg) {
    pthread_mutex_lock(&l->mu);
    if (!l->failed) {
        l->failed = 1;
        l->err_code = code;
        snprintf(l->err, sizeof l->err, "%s", msg);
    }
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void *run(void *arg) {
    rf_msg_link *l = arg;
    double last_heard = rf_time_now();
    for (;;) {
        /* send everything queued */
        pthread_mutex_lock(&l->mu);
        frame *f = l->out_head;
        l->out_head = l->out_tail = NULL;
        l->sending = f != NULL;
        int stop = l->stop;
        pthread_mutex_unlock(&l->mu);
        while (f) {
            frame *next = f->next;
            rf_status st = rf_msg_client_send_raw(l->c, f->buf, f->len);
            free(f->buf), free(f);
            if (st != RF_OK) {
                fail(l, st, rf_error_message());
                while (next) {
                    f = next->next;
                    free(next->buf), free(next);
                    next = f;
                }
            }
            f = next;
        }
        pthread_mutex_lock(&l->mu);
        l->sending = 0;
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
        if (stop) break;
        /* wait for a frame from the controller or a wake-up from the owner */
        zmq_pollitem_t items[2] = {{rf_msg_client_socket(l->c), 0, ZMQ_POLLIN, 0},
                                   {NULL, l->wake[0], ZMQ_POLLIN, 0}};
        int rc = zmq_poll(items, 2, 100);
        if (rc < 0 && zmq_errno() != EINTR) {
            fail(l, RF_ERR_IO, "link: polling the controller's socket failed");
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            char b[64];
            while (read(l->wake[0], b, sizeof b) > 0) {
            }
        }
        double now = rf_time_now();
        int failed = 0;
        while (items[0].revents & ZMQ_POLLIN) {
            rf_msg m;
            int got = 0;
            rf_status st = rf_msg_client_try_recv(l->c, 0, &m, &got);
            if (st != RF_OK) {
                fail(l, st, rf_error_message());
                failed = 1;
                break;
            }
            last_heard = now; /* a ping (answered inside, got = 0) counts */
            if (!got) {
                /* more frames pending? */
                zmq_pollitem_t again = {rf_msg_client_socket(l->c), 0, ZMQ_POLLIN, 0};
                if (zmq_poll(&again, 1, 0) <= 0) break;
                continue;
            }
            inmsg *im = malloc(sizeof *im);
            if (!im) {
                rf_msg_free(&m);
                fail(l, RF_ERR_NOMEM, "out of memory");
                failed = 1;
                break;
            }
            im->m = m, im->next = NULL;
            pthread_mutex_lock(&l->mu);
            if (m.type == RF_MSG_SHUTDOWN) l->shutdown_seen = 1;
            if (l->in_tail) l->in_tail->next = im; else l->in_head = im;
            l->in_tail = im;
            pthread_cond_broadcast(&l->cv);
            pthread_mutex_unlock(&l->mu);
        }
        if (failed) break;
        if (now - last_heard > l->peer_timeout) {
            char msg[512];
            snprintf(msg, sizeof msg, "the controller at %s sent nothing for %.0f s (async.peer_timeout): it is gone or stuck",
                     l->endpoint, l->peer_timeout);
            fail(l, RF_ERR_IO, msg);
            break;
        }
    }
    return NULL;
}

rf_status rf_msg_link_open(rf_msg_link **out, const rf_msg_client_config *cfg, double peer_timeout_s) {
    *out = NULL;
    if (peer_timeout_s <= 0) return rf_error(RF_ERR_ARG, "link: peer timeout must be > 0");
    rf_msg_link *l = calloc(1, sizeof *l);
    if (!l) return rf_error(RF_ERR_NOMEM, "out of memory");
    l->wake[0] = l->wake[1] = -1;
    l->peer_timeout = peer_timeout_s;
    snprintf(l->endpoint, sizeof l->endpoint, "%s", cfg->endpoint ? cfg->endpoint : "");
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    rf_status st = rf_msg_client_connect(&l->c, cfg);
    if (st == RF_OK && pipe2(l->wake, O_NONBLOCK | O_CLOEXEC) != 0)
        st = rf_error(RF_ERR_IO, "link: pipe: %s", strerror(errno));
    if (st == RF_OK && pthread_create(&l->thread, NULL, run, l) != 0)
        st = rf_error(RF_ERR_IO, "link: cannot start its thread");
    if (st != RF_OK) {
        rf_msg_link_close(l);
        return st;
    }
    l->started = 1;
    *out = l;
    return RF_OK;
}

static void wake(rf_msg_link *l) {
    char b = 1;
    ssize_t w = write(l->wake[1], &b, 1);
    (void)w; /* a full pipe already wakes the thread */
}

rf_status rf_msg_link_send(rf_msg_link *l, rf_msg_type type, const ProtobufCMessage *m) {
    frame *f = calloc(1, sizeof *f);
    if (!f) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = rf_msg_encode(type, m, &f->buf, &f->len);
    if (st != RF_OK) {
        free(f);
        return st;
    }
    pthread_mutex_lock(&l->mu);
    if (l->failed) {
        st = rf_error(l->err_code, "%s", l->err);
        pthread_mutex_unlock(&l->mu);
        free(f->buf), free(f);
        return st;
    }
    if (l->out_tail) l->out_tail->next = f; else l->out_head = f;
    l->out_tail = f;
    pthread_mutex_unlock(&l->mu);
    wake(l);
    return RF_OK;
}

static struct timespec abs_after(double s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double t = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + s;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    return ts;
}

rf_status rf_msg_link_recv(rf_msg_link *l, double timeout_s, rf_msg *out, int *got) {
    *got = 0;
    out->pb = NULL;
    struct timespec until = abs_after(timeout_s > 0 ? timeout_s : 0);
    pthread_mutex_lock(&l->mu);
    while (!l->in_head && !l->failed && timeout_s > 0) {
        if (pthread_cond_timedwait(&l->cv, &l->mu, &until) == ETIMEDOUT) break;
    }
    rf_status st = RF_OK;
    if (l->in_head) {
        inmsg *im = l->in_head;
        l->in_head = im->next;
        if (!l->in_head) l->in_tail = NULL;
        *out = im->m;
        *got = 1;
        free(im);
    } else if (l->failed) {
        st = rf_error(l->err_code, "%s", l->err);
    }
    pthread_mutex_unlock(&l->mu);
    return st;
}

int rf_msg_link_shutdown_seen(rf_msg_link *l) {
    pthread_mutex_lock(&l->mu);
    int s = l->shutdown_seen || l->failed;
    pthread_mutex_unlock(&l->mu);
    return s;
}

rf_status rf_msg_link_flush(rf_msg_link *l, double timeout_s) {
    struct timespec until = abs_after(timeout_s);
    pthread_mutex_lock(&l->mu);
    while ((l->out_head || l->sending) && !l->failed)
        if (pthread_cond_timedwait(&l->cv, &l->mu, &until) == ETIMEDOUT) break;
    rf_status st = l->failed ? rf_error(l->err_code, "%s", l->err)
                 : (l->out_head || l->sending) ? rf_error(RF_ERR_IO, "the controller at %s did not take our messages within %.0f s", l->endpoint, timeout_s)
                 : RF_OK;
    pthread_mutex_unlock(&l->mu);
    return st;
}

void rf_msg_link_close(rf_msg_link *l) {
    if (!l) return;
    if (l->started) {
        pthread_mutex_lock(&l->mu);
        l->stop = 1;
        pthread_mutex_unlock(&l->mu);
        wake(l);
        pthread_join(l->thread, NULL);
    }
    for (frame *f = l->out_head; f;) {
        frame *n = f->next;
        free(f->buf), free(f);
        f = n;
    }
    for (inmsg *m = l->in_head; m;) {
        inmsg *n = m->next;
        rf_msg_free(&m->m);
        free(m);
        m = n;
    }
    rf_msg_client_close(l->c);
    if (l->wake[0] >= 0) close(l->wake[0]);
    if (l->wake[1] >= 0) close(l->wake[1]);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l);
}

void rf_msg_link_tell_error(rf_msg_link **l, const rf_msg_client_config *cfg, double peer_timeout_s, rf_status st) {
    char keep[1024];
    snprintf(keep, sizeof keep, "%s", rf_error_message());
    if (!*l) {
        rf_msg_client_config brief = *cfg;
        brief.timeout_s = peer_timeout_s < 5.0 ? peer_timeout_s : 5.0;
        if (rf_msg_link_open(l, &brief, peer_timeout_s) != RF_OK) *l = NULL;
    }
    if (*l) {
        Rlflow__Error e = RLFLOW__ERROR__INIT;
        e.code = st, e.message = keep;
        rf_msg_link_send(*l, RF_MSG_ERROR, &e.base);
        rf_msg_link_flush(*l, 5.0);
    }
    rf_error(st, "%s", keep);
}
