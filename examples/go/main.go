// A vaccel client in Go, written from docs/api.md and the shipped proto alone: mint the
// identity token from the socket's path plus ".id", take a lease with TryAcquire,
// heartbeat it, release it; print one JSON line of what happened.
//
// Build (tests/test_api_doc_client.py does it with Debian's Go packages, offline):
//
//	protoc -I proto --go_out=plugins=grpc:$GOPATH/src proto/vaccel/v1/broker.proto
//	GO111MODULE=off go build -o vaccel-go-client ./examples/go
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "vaccel/api/vaccel/v1"
)

func main() {
	path := os.Getenv("VACCEL_SOCKET")
	if path == "" {
		path = "/run/vaccel/brokerd.sock"
	}
	said := map[string]interface{}{"pid": os.Getpid()}
	dial := func(ctx context.Context, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", path)
	}
	// The dialer reaches the socket; "passthrough" keeps older grpc-go from resolving the name.
	conn, err := grpc.Dial("passthrough:///vaccel", grpc.WithInsecure(), grpc.WithContextDialer(dial))
	check(err)
	defer conn.Close()
	stub := pb.NewBrokerClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// Without a token: the error says what to send.
	_, err = stub.Status(ctx, &pb.StatusRequest{})
	said["missing"] = []string{status.Code(err).String(), status.Convert(err).Message()}

	// api.md, "The identity token": one JSON line from the socket's path plus .id, in this process.
	side, err := net.Dial("unix", path+".id")
	check(err)
	line, err := bufio.NewReader(side).ReadBytes('\n')
	check(err)
	side.Close()
	var minted struct {
		Token string `json:"token"`
	}
	check(json.Unmarshal(line, &minted))
	ctx = metadata.AppendToOutgoingContext(ctx, "vaccel-token", minted.Token)

	// api.md, "A lease from another language".
	update, err := stub.TryAcquire(ctx, &pb.AcquireRequest{Gpus: 1, Command: "api.md Go client"})
	check(err)
	lease := update.GetGranted()
	if lease == nil {
		fail("not granted: " + update.GetQueued().GetMessage())
	}
	said["lease"] = lease.Id
	said["held_by"] = lease.Holder.Pid
	beat, err := stub.Heartbeat(ctx, &pb.LeaseRef{LeaseId: lease.Id})
	check(err)
	said["beat_expires"] = beat.ExpiresAt > 0
	ended, err := stub.Release(ctx, &pb.ReleaseRequest{LeaseId: lease.Id})
	check(err)
	said["released"] = ended.State
	out, _ := json.Marshal(said)
	fmt.Println(string(out))
}

func check(err error) {
	if err != nil {
		fail(err.Error())
	}
}

func fail(message string) {
	fmt.Fprintln(os.Stderr, "vaccel-go-client:", message)
	os.Exit(1)
}
