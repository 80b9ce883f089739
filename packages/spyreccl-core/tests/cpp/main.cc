// Entry point of spyreccl_cpp_tests: runs the tests registered by the test_*.cc files.
// See multiproc.h for the options (--filter, --list, --seed).
#include "multiproc.h"

int main(int argc, char** argv) { return spyreccl_test::runTests(argc, argv); }
