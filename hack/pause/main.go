// pause: the one binary of the local cluster's images for real kubelet nodes (see
// tools/gemini_local/kubelet/). With no arguments it is the CRI sandbox ("pause") process; with
// arguments it prints them as one line and then waits the same way. Either way it exits 0 on
// SIGTERM or SIGINT (as PID 1 of a PID namespace, a signal without a handler is ignored).
//
// Four modes check pod networking between nodes:
//
//	--echo PORT WORDS...  also answers every TCP connection on PORT with WORDS and a newline;
//	--dial ADDR           connects to ADDR (host:port) every half second and prints
//	                      "reply: <line>" or "error: <why>" for each try;
//	--sink PORT           also reads and discards what every TCP connection on PORT sends;
//	--send ADDR BYTES     sends BYTES bytes to ADDR every second and prints
//	                      "sent <n> bytes in <s> s" (or "error: <why>") for each try.
package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// serve accepts TCP connections on port and hands each to handle on its own goroutine.
func serve(port string, handle func(net.Conn)) {
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				continue
			}
			go func() {
				handle(conn)
				conn.Close()
			}()
		}
	}()
}

func echo(port string, words string) {
	serve(port, func(conn net.Conn) { fmt.Fprintln(conn, words) })
}

func dial(addr string) {
	go func() {
		for {
			conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err == nil {
				conn.SetDeadline(time.Now().Add(2 * time.Second))
				line, rerr := bufio.NewReader(conn).ReadString('\n')
				conn.Close()
				if rerr == nil {
					fmt.Println("reply:", strings.TrimSpace(line))
				} else {
					err = rerr
				}
			}
			if err != nil {
				fmt.Println("error:", err)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}()
}

func sink(port string) {
	serve(port, func(conn net.Conn) { io.Copy(io.Discard, conn) })
}

func send(addr string, size int64) {
	block := make([]byte, 64*1024)
	go func() {
		for {
			started := time.Now()
			conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err == nil {
				conn.SetDeadline(time.Now().Add(60 * time.Second))
				var sent int64
				for sent < size && err == nil {
					n := int64(len(block))
					if size-sent < n {
						n = size - sent
					}
					var wrote int
					wrote, err = conn.Write(block[:n])
					sent += int64(wrote)
				}
				if err == nil {
					// Closing waits for nothing: half-close and wait for the sink's end, so
					// that the time covers the bytes' arrival, not only the local buffers.
					conn.(*net.TCPConn).CloseWrite()
					_, err = conn.Read(block[:1])
					if err == io.EOF {
						err = nil
					}
				}
				conn.Close()
				if err == nil {
					fmt.Printf("sent %d bytes in %.3f s\n", sent, time.Since(started).Seconds())
				}
			}
			if err != nil {
				fmt.Println("error:", err)
			}
			time.Sleep(time.Second)
		}
	}()
}

func main() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	args := os.Args[1:]
	switch {
	case len(args) >= 2 && args[0] == "--echo":
		echo(args[1], strings.Join(args[2:], " "))
	case len(args) == 2 && args[0] == "--dial":
		dial(args[1])
	case len(args) == 2 && args[0] == "--sink":
		sink(args[1])
	case len(args) == 3 && args[0] == "--send":
		size, err := strconv.ParseInt(args[2], 10, 64)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(2)
		}
		send(args[1], size)
	}
	if len(args) > 0 {
		fmt.Println(strings.Join(args, " "))
	}
	<-sigs
}
