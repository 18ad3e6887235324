#include <stdio.h>
int main(void) { puts("rlflow"); return 0; }
