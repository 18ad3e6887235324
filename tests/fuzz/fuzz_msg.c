/* The message layer's decoding of a frame from a program rlflow does not control
 * (common/msg.c rf_msg_decode_external: protobuf-c's unpack, then rf_msg_validate's wire-type,
 * NUL and UTF-8 checks) on arbitrary bytes, and the internal decode (no UTF-8 check) on the
 * same bytes. What an accepted frame must also do: encode again and decode again to a frame of
 * the same type, which the external decoder accepts too (its strings now hold what protobuf-c
 * kept). A refusal must carry a message; the external decoder refuses whatever the internal one
 * refuses. */
#include "common/msg.h"
#include "fuzz_util.h"

static void roundtrip(const rf_msg *m) {
    uint8_t *buf = NULL;
    size_t len = 0;
    rf_status st = rf_msg_encode((rf_msg_type)m->type, m->pb, &buf, &len);
    rf_fuzz_check_error(st);
    if (st != RF_OK) abort(); /* an unpacked message always packs */
    rf_msg again;
    uint64_t rid = 0;
    st = rf_msg_decode_external(buf, len, &again, &rid);
    if (st != RF_OK || again.type != m->type) {
        fprintf(stderr, "re-encoded frame of type %d did not decode: %s\n", m->type, rf_error_message());
        abort();
    }
    rf_msg_free(&again);
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rf_msg ext, in;
    uint64_t rid = 0;
    rf_status se = rf_msg_decode_external(data, size, &ext, &rid);
    rf_fuzz_check_error(se);
    rf_error_clear();
    rf_status si = rf_msg_decode(data, size, &in);
    rf_fuzz_check_error(si);
    if (si != RF_OK && se == RF_OK) {
        fprintf(stderr, "the external decoder accepted what the internal one refused\n");
        abort();
    }
    if (se == RF_OK) roundtrip(&ext), rf_msg_free(&ext);
    if (si == RF_OK) rf_msg_free(&in);
    rf_error_clear();
    return 0;
}
